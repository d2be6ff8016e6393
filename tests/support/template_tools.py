"""Driving ``template_worker`` pairs in migration tests: start one, find the one still alive
after a cut, read what it was asked, read a gateway counter.

A cut worker ends with ``os._exit``; the gateway can see its socket close a moment before the
process is reaped, so :func:`survivor` waits for one of the two to have exited rather than
asking once (a worker still exiting, taken for the survivor, answers ``/stats`` with a reset).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import httpx

from tests.support.fault_tools import MODEL
from tests.support.procs import Proc, free_port

DIE_AFTER = 7


def template_worker(tmp: Path, *extra: str, die_after: int = DIE_AFTER) -> Proc:
    """A ``tests.support.template_worker`` on a free port that dies after ``die_after`` pieces."""
    port = free_port()
    argv = [sys.executable, "-m", "tests.support.template_worker", "--port", str(port),
            "--model", MODEL, "--die-after", str(die_after), *extra]  # fmt: skip
    return Proc(argv, f"http://127.0.0.1:{port}", tmp / f"template-{port}.log")


def alive(p: Proc) -> bool:
    return p.proc is not None and p.proc.poll() is None


def survivor_of(a: Proc, b: Proc, timeout: float = 10.0) -> Proc:
    """The one of ``a`` and ``b`` still running once the other has exited (within ``timeout``)."""
    deadline = time.monotonic() + timeout
    while alive(a) and alive(b) and time.monotonic() < deadline:
        time.sleep(0.02)
    states = {p.url: None if p.proc is None else p.proc.poll() for p in (a, b)}
    assert alive(a) != alive(b), f"expected exactly one worker to have exited: {states}"
    return a if alive(a) else b


def asked(p: Proc) -> list[dict[str, Any]]:
    """What ``p`` was asked, in order: ``{"path": ..., "body": ...}``."""
    try:
        return list(httpx.get(p.url + "/stats", timeout=5).json()["seen"])
    except httpx.HTTPError as e:
        state = None if p.proc is None else p.proc.poll()
        raise AssertionError(f"{p.url}/stats: {e!r} (exit status {state}); log:\n{p.logs()}") from e


def metric(gw: Proc, name: str, **labels: str) -> float:
    """The sum of ``name``'s series on ``gw``'s ``/metrics`` that carry ``labels``."""
    text = httpx.get(gw.url + "/metrics", timeout=5).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total
