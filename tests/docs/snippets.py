"""The documentation's runnable snippets, found and run with Sybil.

A fenced block preceded by one of these HTML comments (invisible on the site) is a test:

    <!-- test: run -->           python: run in the page's namespace; sh: ``bash -euo pipefail`` in
                                 a folder of the page's own where the checkout's files are linked
                                 (nothing is written in the checkout), ``gpupool`` on the PATH
    <!-- test: config -->        yaml: ``gpupool check`` passes on it
    <!-- test: serve FILE -->    yaml: says what FILE says; the page's later snippets talk to a
                                 gateway serving FILE instead of ``config/gpupool.yaml``
    <!-- test: serve -->         yaml: the page's later snippets talk to a gateway serving it

Snippets are written for a gateway on ``127.0.0.1:8000``; the gateway they talk to serves the
page's config on a free port, which replaces that address in the snippet before it runs. A
``test:`` comment that names no known kind, or that no fenced block follows, is an error, so a
typo cannot turn a test off.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml
from sybil import Document, Example, Region, Sybil

from tests.support.procs import ROOT, Proc, gateway, running

ADDRESS = "127.0.0.1:8000"
DEFAULT_CONFIG = "config/gpupool.yaml"
DIRECTIVE = re.compile(r"^<!--\s*test:\s*(?P<body>.*?)\s*-->[ \t]*$", re.M)
FENCE = re.compile(r"\n?```(?P<lang>\w+)[^\n]*\n(?P<source>.*?)^```[ \t]*$", re.S | re.M)
ADMIN_KEY = "sk-docs-tests-admin"  # asks /ready of a page's gateway with auth on
KINDS = {"run": {"python", "sh"}, "config": {"yaml"}, "serve": {"yaml"}}


class SnippetError(Exception):
    """A ``test:`` comment the parser cannot use (unknown kind, no block, wrong language)."""


class Gateways:
    """One gateway per served config, started on first use, stopped by :meth:`close`."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self._stack = contextlib.ExitStack()
        self._running: dict[str, Proc] = {}

    def keep(self, text: str) -> str:
        """A page's own config, kept as a file to serve; its path (relative to the root)."""
        path = Path(tempfile.mkstemp(dir=self.tmp, prefix="page-", suffix=".yaml")[1])
        path.write_text(text)
        return str(path)

    def address(self, config: str) -> str:
        proc = self._running.get(config)
        if proc is None:
            proc = self._running[config] = self._start(config)
        return proc.url.removeprefix("http://")

    def _start(self, config: str) -> Proc:
        cfg: dict[str, Any] = yaml.safe_load((ROOT / config).read_text())
        tmp = Path(tempfile.mkdtemp(dir=self.tmp, prefix="gateway-"))
        cfg["server"] = {**cfg.get("server", {}), "state_dir": str(tmp / "state")}
        for worker in cfg["workers"]:  # a simulated GPU's ledger belongs to this run alone
            args = (worker.get("launch") or {}).get("args") or {}
            if "sleep-ledger" in args:
                args["sleep-ledger"] = str(tmp / Path(args["sleep-ledger"]).name)
        auth = cfg.get("auth") or {}
        if not auth.get("enabled"):
            proc = gateway(cfg, tmp)
            self._stack.enter_context(running(proc, ready_path="/ready", timeout=90))
            return proc
        # /ready takes a key when auth is on: an admin key of the test's own asks it
        cfg["auth"] = {**auth, "admin_key_sha256": hashlib.sha256(ADMIN_KEY.encode()).hexdigest()}
        proc = gateway(cfg, tmp)
        self._stack.enter_context(running(proc, ready_path="/health", timeout=90))
        _wait_ready(proc.url, timeout=90)
        return proc

    def close(self) -> None:
        self._stack.close()


def _wait_ready(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    status = None
    while time.monotonic() < deadline:
        r = httpx.get(f"{url}/ready", headers={"authorization": f"Bearer {ADMIN_KEY}"})
        if (status := r.status_code) == 200:
            return
        time.sleep(0.2)
    raise TimeoutError(f"{url}/ready answered {status} for {timeout} s")


def parse(document: Document) -> Iterable[Region]:
    """Every ``test:`` comment of the document and the fenced block after it."""
    for match in DIRECTIVE.finditer(document.text):
        kind, _, arg = match.group("body").partition(" ")
        line = document.text.count("\n", 0, match.start()) + 1
        where = f"{document.path}:{line}"
        if kind not in KINDS:
            raise SnippetError(f"{where}: unknown `test: {kind}` (known: {', '.join(KINDS)})")
        fence = FENCE.match(document.text, match.end())
        if fence is None:
            raise SnippetError(f"{where}: `test: {kind}` is not followed by a fenced block")
        lang = fence.group("lang")
        if lang not in KINDS[kind]:
            raise SnippetError(f"{where}: `test: {kind}` takes {sorted(KINDS[kind])}, not {lang}")
        parsed = (kind, arg.strip(), lang, fence.group("source"), where)
        yield Region(match.start(), fence.end(), parsed, evaluate)


def evaluate(example: Example) -> str | None:
    kind, arg, lang, source, where = example.parsed
    ns = example.namespace
    if kind == "config":
        return _check_config(source, where)
    if kind == "serve":
        if not arg:  # the block itself is the config
            ns["served"] = ns["gateways"].keep(source)
            return None
        served = yaml.safe_load((ROOT / arg).read_text())
        if yaml.safe_load(source) != served:
            return f"{where}: the block does not say what {arg} says"
        ns["served"] = arg
        return None
    if ADDRESS in source:
        source = source.replace(ADDRESS, ns["gateways"].address(ns.get("served", DEFAULT_CONFIG)))
    if lang == "sh":
        return _run_sh(source, where, _workdir(ns))
    try:
        exec(compile(source, where, "exec"), ns)
    except Exception as e:  # the snippet's own failure, reported with where it is
        return f"{where}: {type(e).__name__}: {e}"
    return None


def _env() -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}",
            "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}  # fmt: skip


def _workdir(ns: dict[str, Any]) -> Path:
    """The page's shell folder: the checkout's files linked in, so `config/...` reads as in the
    checkout, while whatever a snippet writes (`gpupool init -o gpupool.yaml`) stays out of it."""
    if "workdir" not in ns:
        work = Path(tempfile.mkdtemp(dir=ns["gateways"].tmp, prefix="sh-"))
        for entry in ROOT.iterdir():
            if not entry.name.startswith("."):
                (work / entry.name).symlink_to(entry)
        ns["workdir"] = work
    return Path(ns["workdir"])


def _run_sh(source: str, where: str, cwd: Path) -> str | None:
    argv = ["bash", "-euo", "pipefail", "-c", source]
    r = subprocess.run(argv, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=120,
                       stdin=subprocess.DEVNULL)  # fmt: skip
    if r.returncode != 0:
        return f"{where}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    return None


def _check_config(source: str, where: str) -> str | None:
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(source)
    try:
        r = subprocess.run([sys.executable, "-m", "gpupool", "check", "--config", f.name],
                           cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120,
                           stdin=subprocess.DEVNULL)  # fmt: skip
    finally:
        os.unlink(f.name)
    return None if r.returncode == 0 else f"{where}: gpupool check failed\n{r.stderr[-2000:]}"


SYBIL = Sybil(parsers=[parse])


def documents() -> list[Path]:
    """The README and every page of the site that has a ``test:`` comment."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [p for p in pages if DIRECTIVE.search(p.read_text())]


def run_document(path: Path, gateways: Gateways) -> int:
    """Run every snippet of ``path`` in order; raise at the first that fails. Returns how many."""
    document = SYBIL.parse(path)
    document.namespace["gateways"] = gateways
    examples = list(document)
    for example in examples:
        example.evaluate()
    return len(examples)


def examples_in(path: Path) -> Iterator[tuple[str, str]]:
    """(kind, language) of each snippet in ``path``."""
    for example in SYBIL.parse(path):
        kind, _, lang, _, _ = example.parsed
        yield kind, lang
