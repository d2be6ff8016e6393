"""A private Docker engine for the image and Compose tests, and the images they need.

:class:`Engine` starts Debian's ``dockerd`` with its own socket, data root and exec root under
a temporary folder, without touching the host's network set-up (no default bridge, no iptables
rules, no IP forwarding change): Compose project networks still work (their bridges exist only
while the project is up), published ports go through Docker's userland proxy. Stopping it
removes every container, network and volume it made, stops the daemon and its containerd, and
deletes its folders.

No registry is reachable here, so every image is built locally: the Python base from Debian
packages (``docker/base/build_base.sh``, its root-filesystem tarball cached in ``.cache/docker``),
gpupool's image from wheels prepared on the host (``docker/wheels.sh``: the documented air-gapped
build), and, for the Compose stack only, a stand-in for the official Redis and Prometheus images
made of the host's own ``redis-server`` and ``prometheus`` binaries on that base
(``docker/base/build_ops.sh``). These are the Compose page's steps, top to bottom.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.support.procs import ROOT

SBIN = ":/usr/sbin:/sbin"
BASE_TAG = "python:3.11-slim"  # the tag docker/Dockerfile's BASE_IMAGE defaults to
GATEWAY_TAG = "gpupool:latest"
REDIS_TAG = "gpupool-test/redis:latest"  # the host's redis-server, for the Compose stack
PROMETHEUS_TAG = "gpupool-test/prometheus:latest"  # the host's prometheus, likewise


def which(name: str) -> str | None:
    return shutil.which(name, path=os.environ.get("PATH", "") + SBIN)


def why_no_engine() -> str | None:
    """The reason a Docker engine cannot run here, or None."""
    if not which("dockerd") or not which("docker-compose"):
        return "docker.io / docker-compose are not installed (`make docker-deps` installs them)"
    if os.geteuid() != 0:
        return "dockerd needs root, and this test runs as an unprivileged user"
    if not Path("/sys/fs/cgroup").is_dir():
        return "no cgroup filesystem: containers cannot run here"
    return None


class Engine:
    """One ``dockerd`` for a test session."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="gpd-", dir="/tmp"))  # short: socket paths
        self.sock = self.dir / "docker.sock"
        self.host = f"unix://{self.sock}"
        self.log = self.dir / "dockerd.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.docker = which("docker.io") or "/usr/bin/docker"  # Debian's client: same version

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "DOCKER_HOST": self.host,
            "DOCKER_BUILDKIT": "0",
            "COMPOSE_DOCKER_CLI_BUILD": "0",
            "PATH": os.environ.get("PATH", "") + SBIN,
        }

    def start(self) -> Engine:
        dockerd = which("dockerd")
        assert dockerd is not None
        argv = [
            dockerd,
            "--host",
            self.host,
            "--data-root",
            str(self.dir / "data"),
            "--exec-root",
            str(self.dir / "exec"),
            "--pidfile",
            str(self.dir / "dockerd.pid"),
            "--bridge=none",
            "--iptables=false",
            "--ip-forward=false",
            "--ip-masq=false",
            "--log-level=warn",
        ]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + 60
        while self.run("version", check=False).returncode != 0:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise EngineError(f"dockerd did not start:\n{self.log.read_text()[-2000:]}")
            time.sleep(0.2)
        return self

    def run(
        self, *args: str, check: bool = True, timeout: float = 600, input: bytes | None = None
    ) -> subprocess.CompletedProcess[str]:
        r = subprocess.run(
            [self.docker, *args],
            capture_output=True,
            text=True,
            env=self.env(),
            timeout=timeout,
            input=input.decode() if input else None,
        )
        if check and r.returncode != 0:
            raise AssertionError(f"docker {' '.join(args)} failed:\n{r.stdout}\n{r.stderr}")
        return r

    def compose(
        self,
        project: str,
        file: Path,
        *args: str,
        env: dict[str, str] | None = None,
        check: bool = True,
    ) -> subprocess.CompletedProcess[str]:
        compose = which("docker-compose")
        assert compose is not None
        r = subprocess.run(
            [compose, "-p", project, "-f", str(file), *args],
            capture_output=True,
            text=True,
            env={**self.env(), **(env or {})},
            timeout=600,
        )
        if check and r.returncode != 0:
            raise AssertionError(f"docker-compose {' '.join(args)} failed:\n{r.stdout}\n{r.stderr}")
        return r

    def leftovers(self) -> dict[str, list[str]]:
        """Containers, networks (beyond Docker's own) and volumes that still exist."""
        return {
            "containers": self.run("ps", "-aq").stdout.split(),
            "networks": [
                n
                for n in self.run("network", "ls", "--format", "{{.Name}}").stdout.split()
                if n not in ("host", "none", "bridge")
            ],
            "volumes": self.run("volume", "ls", "-q").stdout.split(),
        }

    def stop(self) -> None:
        """Remove what is left, stop the daemon (and its containerd), delete its folders."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(Exception):
                ids = self.run("ps", "-aq", check=False).stdout.split()
                if ids:
                    self.run("rm", "-f", "-v", *ids, check=False)
                self.run("network", "prune", "-f", check=False)
                self.run("volume", "prune", "-f", check=False)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        _unmount_under(self.dir)
        shutil.rmtree(self.dir, ignore_errors=True)

    # ---- images --------------------------------------------------------------------------

    def build_base(self) -> float:
        """The Debian base under BASE_TAG; seconds taken."""
        t0 = time.monotonic()
        env = {**self.env(), "DOCKER": f"{self.docker} -H {self.host}"}
        r = subprocess.run(
            ["bash", str(ROOT / "docker" / "base" / "build_base.sh"), BASE_TAG],
            capture_output=True,
            text=True,
            env=env,
            timeout=900,
        )
        assert r.returncode == 0, r.stdout + r.stderr
        return time.monotonic() - t0

    def build_gateway(self) -> float:
        """docker/wheels.sh, then docker/Dockerfile from the repository root; seconds taken."""
        t0 = time.monotonic()
        r = subprocess.run(
            ["bash", str(ROOT / "docker" / "wheels.sh")],
            capture_output=True,
            text=True,
            timeout=900,
            env={**os.environ, "PYTHON": sys.executable},
        )
        assert r.returncode == 0, r.stdout + r.stderr
        self.run(
            "build",
            "--network",
            "host",
            "-q",
            "-f",
            str(ROOT / "docker" / "Dockerfile"),
            "-t",
            GATEWAY_TAG,
            str(ROOT),
        )
        return time.monotonic() - t0

    def build_ops(self) -> None:
        """REDIS_TAG and PROMETHEUS_TAG: the host's redis-server and prometheus on the base (no
        registry for the official images), by ``docker/base/build_ops.sh``, the recipe the
        Compose page gives; the Compose file takes them through REDIS_IMAGE and
        PROMETHEUS_IMAGE."""
        env = {**self.env(), "DOCKER": f"{self.docker} -H {self.host}", "BASE_IMAGE": BASE_TAG}
        r = subprocess.run(
            ["bash", str(ROOT / "docker" / "base" / "build_ops.sh"), REDIS_TAG, PROMETHEUS_TAG],
            capture_output=True,
            text=True,
            env=env,
            timeout=900,
        )
        assert r.returncode == 0, r.stdout + r.stderr

    def image_size(self, tag: str) -> int:
        return int(self.run("image", "inspect", "--format", "{{.Size}}", tag).stdout)

    def has_image(self, tag: str) -> bool:
        return self.run("image", "inspect", tag, check=False).returncode == 0


class EngineError(Exception):
    pass


def _unmount_under(folder: Path) -> None:
    """Unmount anything dockerd left mounted under ``folder`` (overlays, shm, netns)."""
    mounts = Path("/proc/self/mounts").read_text().splitlines()
    inside = [m.split()[1] for m in mounts if m.split()[1].startswith(str(folder))]
    for target in sorted(inside, key=len, reverse=True):
        subprocess.run(["umount", "-l", target], capture_output=True)
