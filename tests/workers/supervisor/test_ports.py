"""Launched workers' ports come from outside the kernel's ephemeral range (``ports.py``)."""

from __future__ import annotations

import socket

import pytest

from gpupool.workers.supervisor import ports
from gpupool.workers.supervisor.ports import ephemeral_range, free_port

HOST = "127.0.0.1"


@pytest.fixture(autouse=True)
def _forget() -> None:
    ports._handed.clear()


def test_a_port_outside_the_ephemeral_range_that_binds_and_is_not_handed_out_twice() -> None:
    eph = ephemeral_range()
    assert eph is not None  # Linux
    got = [free_port(HOST) for _ in range(50)]
    assert len(set(got)) == 50
    for port in got:
        assert port in ports.WORKER_PORTS and port not in eph
        with socket.socket() as s:
            s.bind((HOST, port))


def test_a_port_something_listens_on_is_skipped() -> None:
    taken = free_port(HOST)
    ports._handed.clear()
    with socket.socket() as busy:
        busy.bind((HOST, taken))
        busy.listen()
        assert free_port(HOST, range(taken, taken + 2)) == taken + 1


def test_where_the_range_is_ephemeral_the_kernel_chooses() -> None:
    eph = ephemeral_range()
    assert eph is not None
    port = free_port(HOST, range(eph.start, eph.start + 10))
    assert port in eph  # bind(0)'s port, not one of the ten
