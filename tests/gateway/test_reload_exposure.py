"""A reload cannot turn auth off on a gateway bound beyond loopback: the address checked is the
one bound (``serve --host`` may differ from the file's, and a reload keeps the running one)."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpupool.config import load_config
from gpupool.gateway.errors import BadRequest
from gpupool.gateway.reload import reload_config
from gpupool.gateway.services import build_services


def _file(auth: dict[str, Any]) -> dict[str, Any]:
    return {"models": [{"name": "m"}],
            "workers": [{"name": "w1", "model": "m", "url": "http://127.0.0.1:9"}],
            "auth": auth}  # fmt: skip


def test_a_reload_turning_auth_off_on_a_network_address_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "gpupool.yaml"
    admin = hashlib.sha256(b"admin-key").hexdigest()
    path.write_text(yaml.safe_dump(_file({"enabled": True, "admin_key_sha256": admin})))
    cfg = load_config(path)
    cfg.server.host = "0.0.0.0"  # as `gpupool serve --host 0.0.0.0` sets it

    async def main() -> None:
        svc = build_services(cfg, config_path=path)
        try:
            path.write_text(yaml.safe_dump(_file({"enabled": False})))  # valid on its own
            with pytest.raises(BadRequest) as e:
                await reload_config(svc)
            assert "auth.enabled: false" in e.value.message
            assert svc.auth.state.cfg.enabled  # nothing changed
        finally:
            await svc.close()

    asyncio.run(main())
