"""gpupool deployed as its users deploy it: images built, a Compose stack run, a gateway killed.

A private ``dockerd`` (tests/deploy/docker_env.py) builds the gateway image from
docker/Dockerfile (base and wheels made here: the air-gapped mode) and runs
docker/compose.sim.yaml: two gateway replicas sharing Redis, simulated vLLM workers of one
Compose service found by DNS, and Prometheus. The openai SDK drives both gateways; one is
killed mid-load and the other keeps serving with nothing held; scaling the worker service up
and down is seen by the gateway within ``every_s`` plus a probe; at the end nothing is left
(containers, networks, volumes, the daemon and its mounts).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from tests.deploy.docker_env import (
    BASE_TAG,
    GATEWAY_TAG,
    PROMETHEUS_TAG,
    REDIS_TAG,
    Engine,
    which,
    why_no_engine,
)
from tests.deploy.load import Load, wait_until
from tests.support.hostile_tools import assert_nothing_held
from tests.support.procs import ROOT, free_port

COMPOSE = ROOT / "docker" / "compose.sim.yaml"
CONFIG = yaml.safe_load((ROOT / "docker" / "gpupool.sim.yaml").read_text())
MODEL = CONFIG["models"][0]["name"]
EVERY_S = CONFIG["workers"][0]["discover"]["every_s"]
PROBE_S = CONFIG["routing"]["health_interval_s"]
PROJECT = "gpupool-test"
VLLM_IMAGE_ORDER_BYTES = 10 * 10**9  # the official vllm/vllm-openai image: 10+ GB

pytestmark = [
    pytest.mark.docker,
    pytest.mark.skipif(why_no_engine() is not None, reason=str(why_no_engine())),
    # the first test also builds the images: debootstrap (first run), wheels, the build
    pytest.mark.timeout(1800),
]

# what the run measured, printed at the end (pytest -s) and kept in .cache/docker/last-run.json
MEASURED: dict[str, Any] = {}


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    eng = Engine().start()
    try:
        MEASURED["base_s"] = round(eng.build_base(), 1)
        MEASURED["gateway_build_s"] = round(eng.build_gateway(), 1)
        eng.build_ops()
        yield eng
    finally:
        eng.stop()
        _report()
    assert eng.proc is not None and eng.proc.poll() is not None, "dockerd still running"
    assert not eng.dir.exists(), f"{eng.dir} left behind"
    mounts = Path("/proc/self/mounts").read_text()
    assert str(eng.dir) not in mounts, "mounts of the private dockerd left behind"


def _report() -> None:
    out = ROOT / ".cache" / "docker" / "last-run.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(MEASURED, indent=2))
    print(f"\ndocker stack measurements: {json.dumps(MEASURED)}")


def test_gateway_image_is_small_and_runs_as_non_root(engine: Engine) -> None:
    size = engine.image_size(GATEWAY_TAG)
    MEASURED["gateway_image_mb"] = round(size / 1e6)
    MEASURED["base_image_mb"] = round(engine.image_size(BASE_TAG) / 1e6)
    assert size < 400e6 and size * 20 < VLLM_IMAGE_ORDER_BYTES
    cfg = json.loads(
        engine.run("image", "inspect", "--format", "{{json .Config}}", GATEWAY_TAG).stdout
    )
    assert cfg["User"] == "gpupool" and cfg["Healthcheck"]["Test"][0] == "CMD"
    r = engine.run("run", "--rm", "--network", "none", "--entrypoint", "id", GATEWAY_TAG, "-u")
    assert r.stdout.strip() == "10001"
    r = engine.run("run", "--rm", "--network", "none", GATEWAY_TAG, "--help", check=False)
    assert r.returncode == 0, r.stderr


def test_dockerfile_builds_with_buildkit_and_a_current_client(engine: Engine) -> None:
    """The same Dockerfile with the daemon's BuildKit (no `# syntax=` image to pull; it reads
    Dockerfile.dockerignore) and, where one is installed, a newer docker client."""
    dockerfile = str(ROOT / "docker" / "Dockerfile")
    env = {**engine.env(), "DOCKER_BUILDKIT": "1"}
    t0 = time.monotonic()
    r = _sh(
        [
            engine.docker,
            "build",
            "--network",
            "host",
            "-q",
            "-f",
            dockerfile,
            "-t",
            "gpupool:buildkit",
            str(ROOT),
        ],
        env,
    )
    assert r.returncode == 0, r.stderr
    MEASURED["buildkit_build_s"] = round(time.monotonic() - t0, 1)
    assert engine.image_size("gpupool:buildkit") < 400e6
    newer = which("docker")
    if newer and newer != engine.docker:
        version = _sh([newer, "--version"], engine.env()).stdout.strip()
        r = _sh(
            [
                newer,
                "build",
                "--network",
                "host",
                "-q",
                "-f",
                dockerfile,
                "-t",
                "gpupool:newer-client",
                str(ROOT),
            ],
            engine.env(),
        )
        assert r.returncode == 0, r.stderr
        MEASURED["newer_client"] = version
    engine.run("rmi", "gpupool:buildkit", *(["gpupool:newer-client"] if newer else []), check=False)


def _sh(argv: list[str], env: dict[str, str]) -> Any:
    import subprocess

    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)


class Stack:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.ports = {
            k: free_port() for k in ("GATEWAY_1_PORT", "GATEWAY_2_PORT", "PROMETHEUS_PORT")
        }
        self.env = {
            **self.ports,
            "GPUPOOL_IMAGE": GATEWAY_TAG,
            "REDIS_IMAGE": REDIS_TAG,
            "PROMETHEUS_IMAGE": PROMETHEUS_TAG,
        }
        self.env = {k: str(v) for k, v in self.env.items()}
        self.gw1 = f"http://127.0.0.1:{self.ports['GATEWAY_1_PORT']}"
        self.gw2 = f"http://127.0.0.1:{self.ports['GATEWAY_2_PORT']}"
        self.prom = f"http://127.0.0.1:{self.ports['PROMETHEUS_PORT']}"

    def compose(self, *args: str) -> str:
        return self.engine.compose(PROJECT, COMPOSE, *args, env=self.env).stdout

    def scale(self, n: int) -> None:
        self.compose("up", "-d", "--no-build", "--no-deps", "--scale", f"worker={n}", "worker")

    def container(self, service: str) -> str:
        return self.compose("ps", "-q", service).split()[0]


def _ready_workers(gw: str) -> list[str]:
    try:
        data = httpx.get(gw + "/admin/workers", timeout=5).json()["data"]
    except httpx.HTTPError:
        return []
    return sorted(w["name"] for w in data if w["state"] == "ready")


def _workers(gw: str) -> list[str]:
    return sorted(w["name"] for w in httpx.get(gw + "/admin/workers", timeout=5).json()["data"])


def _targets(prom: str) -> dict[str, list[str]]:
    """Prometheus' active targets by job, as ``health`` values."""
    try:
        data = httpx.get(prom + "/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
    except (httpx.HTTPError, ValueError, KeyError):
        return {}
    out: dict[str, list[str]] = {}
    for t in data:
        out.setdefault(t["labels"]["job"], []).append(t["health"])
    return out


def _all_up(prom: str, gateways: int, workers: int) -> bool:
    t = _targets(prom)
    return t.get("gpupool") == ["up"] * gateways and t.get("vllm") == ["up"] * workers


def _health(engine: Engine, container: str) -> str:
    fmt = "{{.State.Health.Status}}"
    return engine.run("inspect", "--format", fmt, container).stdout.strip()


def test_compose_stack_survives_a_gateway_and_follows_the_worker_scale(engine: Engine) -> None:
    stack = Stack(engine)
    try:
        t0 = time.monotonic()
        stack.compose("up", "-d", "--no-build", "--scale", "worker=2")
        for gw in (stack.gw1, stack.gw2):
            wait_until(lambda gw=gw: len(_ready_workers(gw)) == 2, "two ready workers", 90)
        MEASURED["stack_up_s"] = round(time.monotonic() - t0, 1)

        # the image's HEALTHCHECK, as Docker runs it, and its user, in the running containers
        gw1, gw2 = stack.container("gateway-1"), stack.container("gateway-2")
        for c in (gw1, gw2):
            wait_until(lambda c=c: _health(engine, c) == "healthy", "a healthy gateway", 60)
            assert engine.run("exec", c, "id", "-u").stdout.strip() == "10001"

        # Prometheus sees both gateways and every worker (the workers through the SD file)
        wait_until(lambda: _all_up(stack.prom, 2, 2), "every target up in Prometheus", 60)

        # scale up: the gateways see the third worker within every_s plus a probe
        stack.scale(3)  # returns once the container runs; then DNS, every_s, a probe
        t0 = time.monotonic()
        for gw in (stack.gw1, stack.gw2):
            wait_until(lambda gw=gw: len(_ready_workers(gw)) == 3, "a third worker", 60)
        MEASURED["scale_up_seen_s"] = round(time.monotonic() - t0, 1)
        wait_until(lambda: _all_up(stack.prom, 2, 3), "three worker targets up", 60)

        # two gateways under load; one is killed; the other's clients see no error
        with Load(stack.gw1, MODEL) as on1, Load(stack.gw2, MODEL) as on2:
            on1.wait_for(20)
            on2.wait_for(20)
            engine.run("kill", gw1)
            on2.wait_for(40)
        assert not on2.errors, on2.errors[:5]
        MEASURED["killed_gateway_client_errors"] = len(on1.errors)
        MEASURED["survivor_answers"] = on2.ok
        lease_ttl = CONFIG["queue"]["lease_ttl_s"]
        assert_nothing_held(stack.gw2, within_s=lease_ttl + 5)

        # scale down: the survivor drains and removes two workers
        stack.scale(1)
        t0 = time.monotonic()
        wait_until(lambda: len(_workers(stack.gw2)) == 1, "two workers removed", 60)
        MEASURED["scale_down_seen_s"] = round(time.monotonic() - t0, 1)
        MEASURED["every_s_plus_probe"] = EVERY_S + PROBE_S
        assert len(_ready_workers(stack.gw2)) == 1
    finally:
        logs = stack.compose("logs", "--no-color", "--tail", "30") if _up(stack) else ""
        stack.engine.compose(
            PROJECT,
            COMPOSE,
            "down",
            "-v",
            "--remove-orphans",
            "-t",
            "5",
            env=stack.env,
            check=False,
        )
    left = engine.leftovers()
    assert left == {"containers": [], "networks": [], "volumes": []}, (left, logs[-3000:])


def _up(stack: Stack) -> bool:
    return bool(
        stack.engine.compose(PROJECT, COMPOSE, "ps", "-q", env=stack.env, check=False).stdout
    )


# --- the worker image (docker/worker.Dockerfile) -------------------------------------------

WORKER_DOCKERFILE = ROOT / "docker" / "worker.Dockerfile"


def _vllm_base() -> str:
    for line in WORKER_DOCKERFILE.read_text().splitlines():
        if line.startswith("ARG VLLM_IMAGE="):
            return line.partition("=")[2]
    raise AssertionError("worker.Dockerfile names no VLLM_IMAGE")


def _build_worker(engine: Engine, base: str, tag: str) -> None:
    engine.run(
        "build",
        "--network",
        "host",
        "-q",
        "-f",
        str(WORKER_DOCKERFILE),
        "--build-arg",
        f"VLLM_IMAGE={base}",
        "-t",
        tag,
        str(ROOT),
    )


def test_worker_image_on_the_official_vllm_base(engine: Engine) -> None:
    base = _vllm_base()
    if not engine.has_image(base):
        MEASURED["worker_image"] = f"not built on {base}: not available, no registry here"
        pytest.skip(
            f"{base} is not available to this engine and no registry is reachable "
            "here; the recipe is built on a stand-in base in the next test"
        )
    _build_worker(engine, base, "gpupool-worker:latest")
    r = engine.run(
        "run",
        "--rm",
        "--network",
        "none",
        "--entrypoint",
        "vllm",
        "gpupool-worker:latest",
        "--version",
    )
    assert r.returncode == 0
    MEASURED["worker_image_mb"] = round(engine.image_size("gpupool-worker:latest") / 1e6)


def test_worker_image_recipe_supervises_its_engine_inside(engine: Engine, tmp_path: Path) -> None:
    """The recipe built on the local Python base instead of vLLM's: gpupool installed in
    /opt/gpupool, `gpupool serve` as the entry point, launching and supervising its engine inside
    the container (the simulator, standing in for `vllm serve`), the state and caches on a
    volume, and stopping it cleanly on `docker stop`."""
    tag = "gpupool-worker:stand-in"
    _build_worker(engine, BASE_TAG, tag)
    port = free_port()
    cfg = {
        "server": {"host": "127.0.0.1", "port": port, "state_dir": "/var/lib/gpupool"},
        "models": [{"name": MODEL}],
        "workers": [
            {
                "name": "gpu0",
                "model": MODEL,
                "launch": {
                    "command": ["gpupool", "sim"],
                    "model_path": "unused",
                    "args": {"max-num-seqs": 4},
                },
            }
        ],
    }
    config = tmp_path / "gpupool.yaml"
    config.write_text(yaml.safe_dump(cfg))
    config.chmod(0o644)
    tmp_path.chmod(0o755)
    name = "gpupool-worker-test"
    engine.run(
        "run",
        "-d",
        "--name",
        name,
        "--network",
        "host",
        "-v",
        f"{config}:/etc/gpupool/gpupool.yaml:ro",
        "-v",
        "gpupool-worker-state:/var/lib/gpupool",
        tag,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: _status(url + "/ready") == 200, "the worker container ready", 90)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert reply.choices[0].message.content
        listing = engine.run("exec", name, "ls", "/var/lib/gpupool", "/var/lib/gpupool/logs").stdout
        assert "gpu0.log" in listing  # the supervised engine's log, on the volume
        engine.run("stop", "-t", "30", name)
        code = engine.run("inspect", "--format", "{{.State.ExitCode}}", name).stdout.strip()
        assert code == "0", engine.run("logs", "--tail", "30", name).stderr
    finally:
        engine.run("rm", "-f", name, check=False)
        engine.run("volume", "rm", "gpupool-worker-state", check=False)
        engine.run("rmi", tag, check=False)


def _status(url: str) -> int:
    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.HTTPError:
        return 0
