"""The Docker files hold together, without a Docker engine.

docker/compose.yaml is validated against the official compose-spec JSON schema (the copy that
check-jsonschema ships), then cross-checked with what it runs: the gateway config loads with
gpupool's own loader and points at the compose services, the vLLM containers carry seed 000's
flags (the same as config/examples/seed000-pro6000-5090.yaml) on their reserved GPUs, Prometheus
and Grafana find the files they are given. The Dockerfile is read with dockerfile-parse, and its
command is run as the image would run it, with its HEALTHCHECK asked against it.
"""

from __future__ import annotations

import importlib.resources
import json
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from dockerfile_parse import DockerfileParser
from jsonschema import Draft202012Validator

from gpupool.config import load_config
from gpupool.ops import sd_file_path
from gpupool.workers.supervisor.command import flag_key
from tests.support.procs import ROOT, Proc, free_port, gateway, redis_server, running

DOCKER = ROOT / "docker"
COMPOSE = DOCKER / "compose.yaml"
GATEWAY_CONFIG = DOCKER / "gpupool.compose.yaml"
SEED000 = ROOT / "config" / "examples" / "seed000-pro6000-5090.yaml"
VLLM_WORKERS = {"vllm-big": "big", "vllm-small": "small"}  # compose service -> seed000 worker
_INTERPOLATION = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def _interpolate(value: Any) -> Any:
    """Compose's ``${VAR:-default}`` with nothing set: the default (or empty)."""
    if isinstance(value, str):
        return _INTERPOLATION.sub(lambda m: m.group(2) or "", value)
    if isinstance(value, list):
        return [_interpolate(v) for v in value]
    if isinstance(value, dict):
        return {k: _interpolate(v) for k, v in value.items()}
    return value


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data: dict[str, Any] = _interpolate(yaml.safe_load(COMPOSE.read_text()))
    return data


def _compose_schema() -> dict[str, Any]:
    vendor = importlib.resources.files("check_jsonschema.builtin_schemas.vendor")
    schema: dict[str, Any] = json.loads((vendor / "compose-spec.json").read_text())
    return schema


def test_compose_file_matches_the_compose_spec(compose: dict[str, Any]) -> None:
    validator = Draft202012Validator(
        _compose_schema(), format_checker=Draft202012Validator.FORMAT_CHECKER
    )
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in
              validator.iter_errors(compose)]  # fmt: skip
    assert not errors, "\n".join(errors)


def test_sim_stack_matches_the_compose_spec_and_its_config_loads() -> None:
    """docker/compose.sim.yaml (what tests/deploy/test_stack.py runs) is valid Compose, and its
    gateway configuration finds the `worker` service by DNS."""
    sim = _interpolate(yaml.safe_load((DOCKER / "compose.sim.yaml").read_text()))
    validator = Draft202012Validator(_compose_schema())
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in
              validator.iter_errors(sim)]  # fmt: skip
    assert not errors, "\n".join(errors)
    cfg = load_config(DOCKER / "gpupool.sim.yaml")
    (entry,) = cfg.workers
    assert entry.discover is not None and entry.discover.dns in sim["services"]
    assert cfg.queue.redis_url.startswith("redis://redis:") and "redis" in sim["services"]


def test_compose_spec_schema_catches_mistakes(compose: dict[str, Any]) -> None:
    """The schema is not vacuous: a misspelt key and a bad GPU reservation are errors."""
    validator = Draft202012Validator(_compose_schema())
    broken = json.loads(json.dumps(compose))
    broken["services"]["gateway"]["port"] = ["8000:8000"]
    broken["services"]["vllm-big"]["deploy"]["resources"]["reservations"]["devices"][0][
        "device_ids"
    ] = 0
    assert len(list(validator.iter_errors(broken))) >= 2


def _named_volumes(service: dict[str, Any]) -> dict[str, str]:
    """Named volume -> mount target of a service (bind mounts left out)."""
    out = {}
    for spec in service.get("volumes", []):
        source, target = spec.split(":")[:2]
        if not source.startswith((".", "/")):
            out[source] = target
    return out


def _bind_mounts(service: dict[str, Any]) -> dict[Path, str]:
    out = {}
    for spec in service.get("volumes", []):
        source, target = spec.split(":")[:2]
        if source.startswith("."):
            out[(DOCKER / source).resolve()] = target
    return out


def test_compose_references_resolve(compose: dict[str, Any]) -> None:
    services = compose["services"]
    declared = set(compose["volumes"])
    for name, svc in services.items():
        assert set(_named_volumes(svc)) <= declared, name
        for path in _bind_mounts(svc):
            assert path.exists(), f"{name}: bind mount source {path} is missing"
        for dep in svc.get("depends_on", []):
            assert dep in services, f"{name} depends on unknown service {dep}"
        if "build" in svc:
            context = (DOCKER / svc["build"]["context"]).resolve()
            assert context == ROOT and (context / svc["build"]["dockerfile"]).is_file()


def _flags(argv: list[str]) -> dict[str, Any]:
    """``--key=value`` / ``--flag`` tokens as a mapping (JSON values parsed)."""
    out: dict[str, Any] = {}
    for token in argv:
        assert token.startswith("--"), token
        key, eq, value = token[2:].partition("=")
        out[flag_key(key)] = True if not eq else _scalar(value)
    return out


def _scalar(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def test_vllm_containers_carry_seed000_flags_on_their_gpus(compose: dict[str, Any]) -> None:
    services = compose["services"]
    seed = {w.name: w for w in load_config(SEED000).workers}
    model = load_config(GATEWAY_CONFIG).models[0].name
    for service, worker in VLLM_WORKERS.items():
        svc = services[service]
        model_path, *flags = svc["command"]
        launch = seed[worker].launch
        assert launch is not None and launch.gpus is not None
        assert model_path == launch.model_path
        got = _flags(flags)
        assert {k: got.pop(k) for k in ("host", "port", "served-model-name")} == {
            "host": "0.0.0.0", "port": 8000, "served-model-name": model,
        }  # fmt: skip
        assert got == {flag_key(k): v for k, v in launch.args.items()}, service
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        assert device["device_ids"] == [str(g) for g in launch.gpus]
        assert svc["entrypoint"] == ["vllm", "serve"] and svc["ipc"] == "host"


def test_vllm_containers_share_models_and_caches(compose: dict[str, Any]) -> None:
    big, small = (compose["services"][s] for s in VLLM_WORKERS)
    assert _named_volumes(big) == _named_volumes(small)
    mounts = _named_volumes(big)
    for svc in (big, small):
        env = svc["environment"]
        for var in ("VLLM_CACHE_ROOT", "TRITON_CACHE_DIR", "HF_HOME"):
            assert any(env[var].startswith(t + "/") for t in mounts.values()), var
        assert env["TRITON_CACHE_DIR"] == big["environment"]["TRITON_CACHE_DIR"]


def test_small_card_starts_after_the_big_one_is_warmed(compose: dict[str, Any]) -> None:
    services = compose["services"]
    warm = services["warmup-big"]
    assert warm["depends_on"] == {"vllm-big": {"condition": "service_healthy"}}
    assert services["vllm-small"]["depends_on"] == {
        "warmup-big": {"condition": "service_completed_successfully"}
    }
    args = warm["command"]
    assert warm["entrypoint"][-1] == "gpupool.ops.warmup"
    assert args[args.index("--worker") + 1] == "vllm-big"
    (big,) = [w for w in load_config(GATEWAY_CONFIG).workers if w.name == "vllm-big"]
    sizes = {tuple(size) for item in big.warmup for size in item.images}
    assert {(64, 64), (256, 256), (512, 512)} <= sizes
    assert any(len(item.images) >= 2 for item in big.warmup)
    assert any(item.prompt and not item.images for item in big.warmup)


def test_gateway_config_loads_and_points_at_the_compose_services(compose: dict[str, Any]) -> None:
    cfg = load_config(GATEWAY_CONFIG)
    services = compose["services"]
    gw = services["gateway"]
    assert _bind_mounts(gw)[GATEWAY_CONFIG] == "/etc/gpupool/gpupool.yaml"
    assert cfg.server.host == "0.0.0.0" and cfg.server.port == 8000
    assert _named_volumes(gw)["gpupool-state"] == cfg.server.state_dir
    assert all(w.launch is None for w in cfg.workers)
    for w in cfg.workers:
        assert w.url == f"http://{w.name}:8000" and w.name in services
        flags = _flags(services[w.name]["command"][1:])
        assert w.max_inflight == flags["max-num-seqs"]
    assert cfg.queue.backend.value == "redis" and "redis" in services
    assert cfg.queue.redis_url.startswith("redis://redis:6379/")


def test_prometheus_scrapes_gateway_and_sd_file(compose: dict[str, Any]) -> None:
    cfg = load_config(GATEWAY_CONFIG)
    prom_svc = compose["services"]["prometheus"]
    prom = yaml.safe_load((DOCKER / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in prom["scrape_configs"]}
    assert jobs["gpupool"]["static_configs"] == [{"targets": [f"gateway:{cfg.server.port}"]}]
    (sd,) = jobs["vllm"]["file_sd_configs"]
    assert sd["files"] == [str(sd_file_path(cfg.server.state_dir))]
    assert _named_volumes(prom_svc)["gpupool-state"] == cfg.server.state_dir
    mounted = _bind_mounts(prom_svc)
    assert mounted[DOCKER / "prometheus" / "prometheus.yml"] == "/etc/prometheus/prometheus.yml"
    for rule_file in prom["rule_files"]:
        assert rule_file in mounted.values()
    # the per-GPU relabelling of url: workers matches the compose GPU reservations
    gpus = {r["regex"].lstrip(";"): r["replacement"] for r in jobs["vllm"]["relabel_configs"]}
    reserved = {
        s: compose["services"][s]["deploy"]["resources"]["reservations"]["devices"][0]
        for s in VLLM_WORKERS
    }
    assert gpus == {s: ",".join(d["device_ids"]) for s, d in reserved.items()}


def test_grafana_is_provisioned_with_the_dashboards(compose: dict[str, Any]) -> None:
    grafana = compose["services"]["grafana"]
    mounted = _bind_mounts(grafana)
    provisioning = DOCKER / "grafana" / "provisioning"
    assert mounted[provisioning] == "/etc/grafana/provisioning"
    (ds,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())[
        "datasources"
    ]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090"
    assert "prometheus" in compose["services"]
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "gpupool.yml").read_text())[
        "providers"
    ]
    assert mounted[DOCKER / "grafana" / "dashboards"] == provider["options"]["path"]
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == provider["options"]["path"] + "/gpupool.json"
    assert (DOCKER / "grafana" / "dashboards" / "gpupool.json").is_file()


def test_dashboards_are_generated_from_code_and_current() -> None:
    r = subprocess.run(
        [sys.executable, str(DOCKER / "grafana" / "generate.py"), "--check"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr


def test_dashboard_layout_and_datasource() -> None:
    board = json.loads((DOCKER / "grafana" / "dashboards" / "gpupool.json").read_text())
    panels = board["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        area = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not area & cells, f"{p['title']} overlaps another panel"
        cells |= area
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert p["description"] and p["targets"]


# --- the Dockerfile -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def dockerfile() -> DockerfileParser:
    return DockerfileParser(str(DOCKER / "Dockerfile"))


def _last_stage(parser: DockerfileParser) -> list[dict[str, str]]:
    structure = [{"instruction": i["instruction"], "value": i["value"]} for i in parser.structure]
    last_from = max(i for i, ins in enumerate(structure) if ins["instruction"] == "FROM")
    return structure[last_from:]


def _instruction(stage: list[dict[str, str]], name: str) -> str:
    (value,) = [ins["value"] for ins in stage if ins["instruction"] == name]
    return value


def test_dockerfile_runs_gpupool_serve_as_non_root(
    dockerfile: DockerfileParser, tmp_path: Path
) -> None:
    stage = _last_stage(dockerfile)
    assert dockerfile.baseimage == "python:3.11-slim"
    user = _instruction(stage, "USER")
    assert user.split(":")[0] not in ("root", "0")
    # gpupool is installed into a virtual environment in the build stage and copied over
    assert any(
        i["instruction"] == "COPY" and "/opt/gpupool /opt/gpupool" in i["value"] for i in stage
    )
    assert "/opt/gpupool/bin:" in _instruction(stage, "ENV")
    assert json.loads(_instruction(stage, "ENTRYPOINT")) == ["gpupool"]
    cmd = json.loads(_instruction(stage, "CMD"))
    assert cmd == ["serve", "--config", "/etc/gpupool/gpupool.yaml"]
    # `gpupool` is the console script for the CLI the tests run as `python -m gpupool`
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["gpupool"] == "gpupool.cli.main:main"
    test_argv = gateway({}, tmp_path).argv
    assert test_argv[1:3] == ["-m", "gpupool"] and test_argv[3:5] == cmd[:2]


def test_dockerfile_healthcheck_asks_health(dockerfile: DockerfileParser) -> None:
    check = _healthcheck(dockerfile)
    assert "127.0.0.1:8000/health" in " ".join(check)


def _healthcheck(dockerfile: DockerfileParser) -> list[str]:
    value = _instruction(_last_stage(dockerfile), "HEALTHCHECK")
    options, _, command = value.partition("CMD")
    assert "--interval=" in options and "--timeout=" in options
    command = command.strip()
    return list(json.loads(command)) if command.startswith("[") else shlex.split(command)


def test_dockerignore_keeps_what_the_dockerfile_copies(dockerfile: DockerfileParser) -> None:
    ignore = (DOCKER / "Dockerfile.dockerignore").read_text().splitlines()
    kept = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert ignore[ignore.index("*") :] and "*" in ignore
    for ins in dockerfile.structure:
        if ins["instruction"] == "COPY" and "--from" not in ins["value"]:
            *sources, _ = ins["value"].split()
            assert all(s.rstrip("/") in kept for s in sources), ins["value"]


def test_dockerfile_builds_without_a_frontend_image() -> None:
    """No `# syntax=` line: BuildKit would pull docker/dockerfile from a registry for it."""
    for name in ("Dockerfile", "worker.Dockerfile"):
        first = (DOCKER / name).read_text().splitlines()[0]
        assert not first.lower().replace(" ", "").startswith("#syntax="), name


def test_dockerignore_files_agree() -> None:
    """BuildKit reads docker/<Dockerfile>.dockerignore, the legacy builder and Compose v1 the
    root .dockerignore: both send the same files."""

    def rules(path: Path) -> list[str]:
        return [ln for ln in path.read_text().splitlines() if ln and not ln.startswith("#")]

    root = rules(ROOT / ".dockerignore")
    assert rules(DOCKER / "Dockerfile.dockerignore") == root
    assert rules(DOCKER / "worker.Dockerfile.dockerignore") == root


def test_image_command_serves_and_passes_its_healthcheck(
    dockerfile: DockerfileParser, tmp_path: Path
) -> None:
    """The image's ENTRYPOINT + CMD with the compose config (addresses made local), as the
    container would run it; then the HEALTHCHECK command, pointed at it, must succeed."""
    stage = _last_stage(dockerfile)
    argv = json.loads(_instruction(stage, "ENTRYPOINT")) + json.loads(_instruction(stage, "CMD"))
    assert argv[0] == "gpupool"
    cfg = yaml.safe_load(GATEWAY_CONFIG.read_text())
    port = free_port()
    redis = redis_server(tmp_path)
    cfg["server"] |= {"host": "127.0.0.1", "port": port, "state_dir": str(tmp_path / "state")}
    cfg["queue"]["redis_url"] = redis.url
    config = tmp_path / "gpupool.yaml"
    config.write_text(yaml.safe_dump(cfg))
    binary = str(Path(sys.executable).with_name("gpupool"))
    argv = [binary, *argv[1:-1], str(config)]
    gw = Proc(argv, f"http://127.0.0.1:{port}", tmp_path / "gateway.log")
    with running(redis), running(gw, ready_path="/health"):
        check = [a.replace("127.0.0.1:8000", f"127.0.0.1:{port}") for a in _healthcheck(dockerfile)]
        check[0] = sys.executable if check[0] == "python" else check[0]
        assert subprocess.run(check, timeout=10).returncode == 0
        assert json.loads(sd_file_path(tmp_path / "state").read_text()) == []  # none ready
    # and the healthcheck fails once the gateway is gone
    assert subprocess.run(check, capture_output=True, timeout=10).returncode != 0


# --- the worker image (docker/worker.Dockerfile) -------------------------------------------


def test_worker_image_runs_gpupool_over_the_official_vllm_image() -> None:
    """FROM the official vLLM image (the same tag docker/compose.yaml runs), gpupool in its own
    virtual environment (vLLM's packages untouched), gpupool serve as the entry point."""
    parser = DockerfileParser(str(DOCKER / "worker.Dockerfile"))
    compose_image = _interpolate(yaml.safe_load(COMPOSE.read_text())["x-vllm"]["image"])
    assert parser.baseimage == compose_image and compose_image.startswith("vllm/vllm-openai:")
    stage = _last_stage(parser)
    run = " ".join(i["value"] for i in stage if i["instruction"] == "RUN")
    assert "python3 -m venv /opt/gpupool" in run and "/opt/gpupool/bin/pip install" in run
    assert json.loads(_instruction(stage, "ENTRYPOINT")) == ["gpupool"]
    assert json.loads(_instruction(stage, "CMD")) == [
        "serve",
        "--config",
        "/etc/gpupool/gpupool.yaml",
    ]
    assert "/health" in _instruction(stage, "HEALTHCHECK")


def test_worker_config_is_seed000_with_caches_on_the_state_volume() -> None:
    """The worker image's configuration is seed 000's, supervised inside the container, with
    state (and so the GPU-keyed caches, <state_dir>/cache/<sm_XY>) at /var/lib/gpupool."""
    worker = load_config(DOCKER / "gpupool.worker.yaml")
    seed = load_config(SEED000)
    assert worker.models == seed.models and worker.workers == seed.workers
    assert all(w.launch is not None for w in worker.workers)
    assert worker.server.host == "0.0.0.0" and worker.server.port == 8000
    assert worker.server.state_dir == "/var/lib/gpupool"
