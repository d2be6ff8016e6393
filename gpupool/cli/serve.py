"""``gpupool serve``: logging, the app, and uvicorn (uvloop + httptools)."""

from __future__ import annotations

import logging
import sys

import uvicorn

from gpupool.cli.logs import setup_logging
from gpupool.cli.progress import StartupProgress
from gpupool.config.models import GpupoolConfig, unauthenticated_exposure
from gpupool.gateway.api.app import create_app
from gpupool.gateway.api.protocol import guarded_protocol
from gpupool.gateway.services import Services

log = logging.getLogger("gpupool")


def run_server(cfg: GpupoolConfig, config_path: str) -> None:
    setup_logging(cfg.server.log_format.value)
    problem = unauthenticated_exposure(cfg)  # again: `--host` may have changed the address
    if problem is not None:
        log.error("refusing to start: %s", problem)
        sys.exit(2)

    def show_progress(svc: Services) -> None:
        progress = StartupProgress(cfg, svc.registry)
        svc.registry.on_change(progress.on_change)
        if svc.swap_leases is not None:  # a standby replica stops waiting on SIGTERM
            svc.swap_leases.stopping = lambda: server.should_exit

    app = create_app(cfg, config_path=config_path, on_services=show_progress)
    config = uvicorn.Config(
        app,
        host=cfg.server.host,
        port=cfg.server.port,
        loop="uvloop",
        http=guarded_protocol(
            cfg.server.header_timeout_s,
            cfg.server.max_header_bytes,
            cfg.server.write_timeout_s,
            cfg.server.write_min_bytes,
        ),
        access_log=cfg.server.access_log,
        # X-Forwarded-For only matters to the access log's client address; without that log,
        # uvicorn's proxy-headers middleware would be one more layer on every request.
        proxy_headers=cfg.server.access_log,
        # No `server: uvicorn` on every response: one header less to check and write, and
        # nothing that names the server software to a client.
        server_header=False,
        log_config=None,
        lifespan="on",
        timeout_graceful_shutdown=int(cfg.server.shutdown_grace_s),
        timeout_keep_alive=30,
        h11_max_incomplete_event_size=64 * 1024,
        ssl_certfile=cfg.server.ssl_certfile,
        ssl_keyfile=cfg.server.ssl_keyfile,
    )
    server = uvicorn.Server(config)
    server.run()
    if not server.started:
        sys.exit(1)
