"""Ports for launched workers that stay free until the worker binds them.

A port found by binding port 0 comes from the kernel's ephemeral range, the range it also hands
to outgoing connections; between the check and the worker's own bind (a second for the
simulator, tens of seconds for vLLM) any connection the host opens may take it, and the worker
then fails to start with "address already in use". So a worker's port comes from ``WORKER_PORTS``
when that range lies outside the ephemeral one (read from ``/proc``), picked at random among the
ports that bind now and that this process did not hand out in the last ``HOLD_S`` seconds; only a
host whose ephemeral range covers it falls back to port 0. An operator who needs a fixed port
sets ``launch.port``.
"""

from __future__ import annotations

import random
import socket
import time
from pathlib import Path

WORKER_PORTS = range(10_000, 20_000)  # below Linux's default ephemeral range, 32768-60999
HOLD_S = 300.0  # a worker binds within its startup timeout; a restart gets a new port anyway
EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")

_handed: dict[int, float] = {}  # port → when it was handed out (this process)


def ephemeral_range() -> range | None:
    """The kernel's range for outgoing connections' ports; None where it cannot be read."""
    try:
        low, high = (int(p) for p in EPHEMERAL.read_text().split())
    except (OSError, ValueError):
        return None
    return range(low, high + 1)


def free_port(host: str, ports: range = WORKER_PORTS, tries: int = 200) -> int:
    """A port on ``host`` that nothing listens on, outside the ephemeral range where it can."""
    eph = ephemeral_range()
    if eph is not None and (ports.stop <= eph.start or ports.start >= eph.stop):
        now = time.monotonic()
        for port, at in list(_handed.items()):
            if now - at > HOLD_S:
                del _handed[port]
        for _ in range(tries):
            port = random.choice(ports)
            if port not in _handed and _bindable(host, port):
                _handed[port] = now
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # the kernel's choice
        s.bind((host, 0))
        found: int = s.getsockname()[1]
        return found


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
