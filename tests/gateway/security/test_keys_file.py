"""Keys files name the line of a problem; a revoked key's queued request is refused with 401
and its wait cancelled (no HTTP: ``KeyStore``, ``load_keys_file`` and ``KeyRequests``)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gpupool.config.models import ApiKey, AuthConfig
from gpupool.gateway.errors import Unauthorized
from gpupool.gateway.security.keys import KeysFileError, KeyStore, Principal, load_keys_file
from gpupool.gateway.security.revoke import KeyRequests

A, B = "a" * 64, "b" * 64


def test_an_invalid_entry_names_the_file_and_its_line(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(f"keys:\n  - name: a\n    sha256: {A}\n  - name: b\n    sha256: short\n")
    with pytest.raises(KeysFileError, match=rf"^{path}:5: keys\[1\]\.sha256: String should"):
        load_keys_file(str(path))
    path.write_text(f"- name: a\n  sha256: {A}\n- name: b\n  sha256: {B}\n  rpm: -3\n")
    with pytest.raises(KeysFileError, match=rf"^{path}:5: keys\[1\]\.rpm:"):
        load_keys_file(str(path))  # a bare list works the same
    path.write_text(f"- name: a\n  sha256: {A}\n- name: b\n  sha256: {B}\n  nope: 1\n")
    with pytest.raises(KeysFileError, match=rf"^{path}:5: keys\[1\]\.nope: Extra inputs"):
        load_keys_file(str(path))


def test_a_file_that_is_not_yaml_or_missing_is_named(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text("keys:\n  - {name: a\n  - b\n")
    with pytest.raises(KeysFileError, match=rf"^{path}:\d+: not valid YAML"):
        load_keys_file(str(path))
    with pytest.raises(KeysFileError, match="cannot read the keys file"):
        load_keys_file(str(tmp_path / "absent.yaml"))


def test_two_keys_with_one_hash_are_refused(tmp_path: Path) -> None:
    cfg = AuthConfig(keys=[ApiKey(name="a", sha256=A), ApiKey(name="b", sha256=A.upper())])
    with pytest.raises(KeysFileError, match="same sha256"):
        KeyStore(cfg)


def test_priority_range_defaults_to_the_default_priority_and_below() -> None:
    key = ApiKey(sha256=A)
    assert (key.priority_min, key.priority_max) == (0, 1000)
    with pytest.raises(ValueError, match="priority_min"):
        ApiKey(sha256=A, priority_min=5, priority_max=1)


def _principal(sha: str) -> Principal:
    return Principal("k", "k", key=ApiKey(name="k", sha256=sha))


async def test_a_revoked_keys_wait_is_cancelled_and_refused() -> None:
    valid = {A, B}
    requests = KeyRequests(lambda key: key.sha256 in valid)
    slot_a: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    slot_b: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    a = asyncio.create_task(requests.wait(_principal(A), slot_a))
    b = asyncio.create_task(requests.wait(_principal(B), slot_b))
    anonymous = asyncio.create_task(requests.wait(None, asyncio.sleep(0, "x")))
    await asyncio.sleep(0)
    assert requests.waiting(A) == 1 and requests.waiting(B) == 1
    valid.discard(A)
    assert requests.revoke([A]) == 1
    with pytest.raises(Unauthorized, match="revoked"):
        await a
    assert slot_a.cancelled()  # the wait itself (admission's) was cancelled: it cleans up
    assert not a.cancelled() and requests.waiting(A) == 0
    slot_b.set_result("w")
    assert await b == "w" and await anonymous == "x"
    assert requests.waiting(B) == 0
    # revoked between the door and the queue: refused before it waits
    never = asyncio.get_running_loop().create_future()
    with pytest.raises(Unauthorized):
        await requests.wait(_principal(A), never)


async def test_a_client_leaving_is_still_a_cancellation() -> None:
    requests = KeyRequests(lambda key: True)
    slot: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(requests.wait(_principal(A), slot))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert requests.waiting(A) == 0


def test_serve_and_check_name_a_broken_keys_files_line(tmp_path: Path) -> None:
    """A restart with a broken keys file stops with the line named, not a traceback."""
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys:\n  - name: a\n    sha256: short\n")
    cfg = tmp_path / "gpupool.yaml"
    cfg.write_text(yaml.safe_dump({
        "models": [{"name": "m"}], "workers": [{"name": "w", "model": "m", "url": "http://x"}],
        "auth": {"enabled": True, "keys_file": str(keys)}}))  # fmt: skip
    for command in ("check", "serve"):
        out = subprocess.run([sys.executable, "-m", "gpupool", command, "--config", str(cfg)],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
        assert out.returncode == 2, out.stderr
        assert f"{keys}:3: keys[0].sha256" in out.stderr and "Traceback" not in out.stderr
