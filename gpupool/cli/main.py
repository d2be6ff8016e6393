"""The ``gpupool`` command line: serve, check, sim, plan, gpus, init, status."""

from __future__ import annotations

import importlib
import sys

import click

from gpupool.config import ConfigError, GpupoolConfig, load_config
from gpupool.gateway.security.keys import KeysFileError, KeyStore

EPILOG_SERVE = """\b
Examples:
  gpupool serve --config config/gpupool.yaml
  gpupool serve --config gpupool.yaml --port 9000 --log-format json
"""

EPILOG_CHECK = """\b
Examples:
  gpupool check --config config/gpupool.yaml
  gpupool check --config config/examples/seed000-pro6000-5090.yaml
  gpupool check --config gpupool.yaml --gpu "RTX PRO 6000,RTX 5090"
"""


def _load(path: str) -> GpupoolConfig:
    from gpupool.workers.supervisor.command import check_launch

    try:
        cfg = load_config(path)
        problems = [f"workers[{i}].{p}" for i, w in enumerate(cfg.workers) if w.launch
                    for p in check_launch(w.launch)]  # fmt: skip
        try:
            KeyStore(cfg.auth)  # the keys file too, its problems named by file and line
        except KeysFileError as e:
            problems.append(str(e))
        if problems:
            raise ConfigError(problems)
        return cfg
    except ConfigError as e:
        click.echo(f"error: invalid configuration {path}:", err=True)
        for p in e.problems:
            click.echo(f"  {p}", err=True)
        sys.exit(2)


class _Commands(click.Group):
    """The commands defined elsewhere load when named (or listed by ``--help``): ``gpupool
    serve`` starts without importing the planner, the simulator's command line or ``init``'s
    templates (0.09 s of CPU for every gateway a test starts, at ``fdcc3cf``)."""

    ELSEWHERE = {
        "gpus": "gpupool.workers.planner.cli",
        "init": "gpupool.cli.init",
        "plan": "gpupool.workers.planner.cli",
        "sim": "gpupool.workers.sim.cli",
    }

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.ELSEWHERE})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        module = self.ELSEWHERE.get(cmd_name)
        if module is None:
            return super().get_command(ctx, cmd_name)
        command = getattr(importlib.import_module(module), cmd_name)
        assert isinstance(command, click.Command), (module, cmd_name)
        return command


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="gpupool")
def cli() -> None:
    """gpupool: an OpenAI-compatible gateway and supervisor for a pool of vLLM workers."""


@cli.command(epilog=EPILOG_SERVE)
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False),
              help="The gpupool.yaml to serve.")  # fmt: skip
@click.option("--host", default=None, help="Override server.host.")
@click.option("--port", default=None, type=int, help="Override server.port.")
@click.option("--log-format", type=click.Choice(["text", "json"]), default=None,
              help="Override server.log_format.")  # fmt: skip
def serve(config_path: str, host: str | None, port: int | None, log_format: str | None) -> None:
    """Serve the OpenAI-compatible API in front of the configured workers."""
    from gpupool.cli.serve import run_server

    cfg = _load(config_path)
    if host is not None:
        cfg.server.host = host
    if port is not None:
        cfg.server.port = port
    if log_format is not None:
        cfg.server.log_format = log_format  # type: ignore[assignment]
    run_server(cfg, config_path)


@cli.command(epilog=EPILOG_CHECK)
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False),
              help="The gpupool.yaml to validate.")  # fmt: skip
@click.option("--gpu", "gpu_names", help="The cards behind GPU 0, 1, ...: \"RTX PRO 6000,RTX "
              "5090\" or 2xH200 (default: NVML, else the config's `gpus:`).")  # fmt: skip
@click.option("--gpu-memory-gb", help="GiB of GPU 0, 1, ...: 95.6,31.8 or 2x79.2.")
def check(config_path: str, gpu_names: str | None, gpu_memory_gb: str | None) -> None:
    """Validate a configuration (and its GPU layout) without serving."""
    from gpupool.cli.check import run_check

    sys.exit(run_check(_load(config_path), config_path, gpu_names, gpu_memory_gb))


@cli.command(epilog="\b\nExamples:\n  gpupool status\n  gpupool status --url http://gw:8000")
@click.option("--url", default="http://127.0.0.1:8000", help="The gateway to ask.")
@click.option("--admin-key", envvar="GPUPOOL_ADMIN_KEY", default=None, help="Admin key.")
@click.option("--json", "as_json", is_flag=True, help="Print the raw JSON.")
@click.option("--wide", is_flag=True, help="Every column (GPUs, window, requests, KV cache...).")
def status(url: str, admin_key: str | None, as_json: bool, wide: bool) -> None:
    """Show every worker's state, load and errors as a table (80 columns; --wide: all), and
    each swap group's holder, waiting requests and switches."""
    from gpupool.cli.status import run_status

    sys.exit(run_status(url, admin_key, as_json, wide))


@cli.command("new-key", epilog="\b\nExamples:\n  gpupool new-key --name alice --tenant team-a\n"
             "  gpupool new-key --admin")  # fmt: skip
@click.option("--name", default="", help="A label for logs and metrics.")
@click.option("--tenant", default=None, help="Fairness group (defaults to the name).")
@click.option("--admin", is_flag=True, help="Make an admin key (for /admin/*).")
def new_key(name: str, tenant: str | None, admin: bool) -> None:
    """Create an API key: prints the secret once, and the hash to put in the config."""
    import secrets

    from gpupool.gateway.security.keys import hash_key

    secret = "sk-gp-" + secrets.token_urlsafe(32)
    digest = hash_key(secret)
    click.echo(f"secret (give it to the user; it is not stored): {secret}\n")
    if admin:
        click.echo(f"auth:\n  enabled: true\n  admin_key_sha256: {digest}")
        return
    click.echo("auth:\n  enabled: true\n  keys:")
    click.echo(f"    - name: {name or 'key'}\n      sha256: {digest}")
    if tenant:
        click.echo(f"      tenant: {tenant}")


def main() -> None:
    cli(prog_name="gpupool")  # also under `python -m gpupool`: usage and --version say gpupool
