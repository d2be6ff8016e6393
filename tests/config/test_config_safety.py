"""Config mistakes that would silently weaken the gateway: a key given twice (YAML keeps the
last, so a second `auth:` could turn auth off), and auth off on an address other machines
reach. Each is refused by config load, `gpupool check`, `gpupool serve` and a reload."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from gpupool.config import ConfigError, load_config
from gpupool.gateway.security.keys import KeysFileError, load_keys_file
from tests.support.procs import free_port, gateway, running, sim

BASE = """\
models:
  - name: m
workers:
  - name: w
    model: m
    url: http://127.0.0.1:9
"""
TWO_AUTH = (
    BASE
    + "auth:\n  enabled: true\n  keys: []\nqueue:\n  max_queued: 3\n"
    + ("auth:\n  enabled: false\n")
)


def _gpupool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpupool", *args],
                          capture_output=True, text=True, timeout=30)  # fmt: skip


def test_a_second_top_level_section_is_an_error_naming_both_lines(tmp_path: Path) -> None:
    path = tmp_path / "gpupool.yaml"
    path.write_text(TWO_AUTH)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert e.value.problems == [
        f"{path}:12: auth: given twice, on lines 7 and 12 (YAML would keep only the last); "
        "remove one"
    ]
    r = _gpupool("check", "--config", str(path))
    assert r.returncode == 2 and "lines 7 and 12" in r.stderr


def test_duplicates_deep_inside_lists_are_named_with_their_path(tmp_path: Path) -> None:
    path = tmp_path / "gpupool.yaml"
    path.write_text(
        "models:\n  - name: m\n    reasoning: qwen3\n    reasoning: none\n"
        "workers:\n  - name: w\n    model: m\n    url: http://127.0.0.1:9\n"
        "    launch_not: 1\n    max_inflight: 2\n    max_inflight: 3\n"
    )
    with pytest.raises(ConfigError) as e:
        load_config(path)
    text = str(e.value)
    assert f"{path}:4: models[0].reasoning: given twice, on lines 3 and 4" in text
    assert f"{path}:11: workers[0].max_inflight: given twice, on lines 10 and 11" in text


def test_yaml_merge_keys_are_not_duplicates(tmp_path: Path) -> None:
    path = tmp_path / "gpupool.yaml"
    path.write_text(
        "models: [{name: m}]\n"
        "workers:\n  - &w {name: a, model: m, url: 'http://127.0.0.1:9', max_inflight: 2}\n"
        "  - <<: *w\n    name: b\n"
    )
    assert [w.name for w in load_config(path).workers] == ["a", "b"]


def test_a_keys_file_with_a_key_given_twice_is_refused_naming_both_lines(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(f"keys:\n  - name: a\n    sha256: {'a' * 64}\n    models: [m]\n"
                    f"    models: null\n")  # fmt: skip
    with pytest.raises(KeysFileError) as e:
        load_keys_file(str(path))
    assert f"{path}:5: keys[0].models: given twice, on lines 4 and 5" in str(e.value)


def test_auth_off_on_a_network_address_is_refused_unless_said_explicitly(tmp_path: Path) -> None:
    path = tmp_path / "gpupool.yaml"
    path.write_text(BASE + "server:\n  host: 0.0.0.0\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert "auth.allow_unauthenticated_network: true" in str(e.value)
    r = _gpupool("check", "--config", str(path))
    assert r.returncode == 2 and "not a loopback address" in r.stderr
    r = _gpupool("serve", "--config", str(path))
    assert r.returncode == 2 and "not a loopback address" in r.stderr
    # loopback, or keys on, or the explicit opt-in: fine
    for extra in ("server:\n  host: 127.0.0.2\n", "server:\n  host: '::1'\n",
                  "server:\n  host: 0.0.0.0\nauth:\n  allow_unauthenticated_network: true\n",
                  f"server:\n  host: 0.0.0.0\nauth:\n  enabled: true\n"
                  f"  admin_key_sha256: {'a' * 64}\n"):  # fmt: skip
        path.write_text(BASE + extra)
        assert load_config(path).server is not None


def test_serve_host_override_to_a_network_address_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "gpupool.yaml"
    path.write_text(BASE + f"server:\n  port: {free_port()}\n  state_dir: {tmp_path}/s\n")
    r = _gpupool("serve", "--config", str(path), "--host", "0.0.0.0")
    assert r.returncode == 2 and "refusing to start" in r.stderr


def test_reload_refuses_duplicates_and_auth_off_on_the_network(tmp_path: Path) -> None:
    worker = sim(tmp=tmp_path)
    cfg = {"models": [{"name": "m"}], "workers": [{"name": "w", "model": "m", "url": worker.url}]}
    gw = gateway(cfg, tmp_path)
    with running(worker, gw):
        path = next(tmp_path.glob("gpupool-*.yaml"))
        good = path.read_text()
        path.write_text(good + "queue:\n  max_queued: 3\nqueue:\n  max_queued: 4\n")
        r = httpx.post(gw.url + "/admin/reload", timeout=60)
        assert r.status_code == 400
        assert "queue: given twice, on lines" in r.json()["error"]["message"]
        data = yaml.safe_load(good)
        data["server"]["host"] = "0.0.0.0"
        path.write_text(yaml.safe_dump(data))
        r = httpx.post(gw.url + "/admin/reload", timeout=60)
        assert r.status_code == 400 and "not a loopback address" in r.text
