"""A queued request whose client has gone is never sent (issue 26's flaky fault test).

The race: clients that hang up together are read one by one. The first close cancels the
running request, whose slot goes at once to the next waiter; that waiter's own close sits in the
kernel, unread, and the request went to the worker. Now a request that waited asks its client
first (``Incoming.left``: the lane peeks at the socket, where the close is before the event
loop has read it).
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Callable

import pytest

from gpupool.gateway.api.lane import Lane
from gpupool.gateway.errors import ClientGone
from gpupool.gateway.pipeline.kinds import KINDS
from tests.gateway.test_pipeline import FakePath, _answer_after, _completion, rig


@pytest.fixture
async def accepted() -> AsyncIterator[tuple[asyncio.Transport, socket.socket]]:
    """A served connection's transport and its client's plain socket."""
    loop = asyncio.get_running_loop()
    got: asyncio.Future[asyncio.Transport] = loop.create_future()

    class Proto(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            got.set_result(transport)  # type: ignore[arg-type]

    server = await loop.create_server(Proto, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    transport = await got
    yield transport, client
    client.close()
    transport.close()
    server.close()


def _block(seconds: float) -> None:
    """Wait without letting the event loop run."""
    time.sleep(seconds)


def _block_until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "the close never showed"
        _block(0.005)


def _lane(transport: asyncio.Transport) -> Lane:
    lane = Lane.__new__(Lane)  # only what client_gone reads
    lane._gone, lane.transport = False, transport
    return lane


async def test_a_close_the_loop_has_not_read_yet_is_seen(
    accepted: tuple[asyncio.Transport, socket.socket],
) -> None:
    transport, client = accepted
    lane = _lane(transport)
    assert not lane.client_gone()
    client.sendall(b"pipelined bytes")  # unread data is no close
    _block(0.05)
    assert not lane.client_gone()
    await asyncio.sleep(0.05)  # (the loop reads the bytes)
    client.close()
    _block_until(lane.client_gone)  # the FIN is in the kernel; the loop has not run since
    assert not transport.is_closing()


async def test_a_waiter_whose_client_left_is_never_sent() -> None:
    """One running, one queued; the queued one's client is gone (its close unread) when the
    running one's slot frees: it is not sent, and everything is given back."""
    gate = asyncio.Event()
    r = rig(FakePath(_answer_after(gate)))
    kind = KINDS["/v1/completions"]
    first = asyncio.ensure_future(r.pipeline.handle(kind, r.incoming(), _completion()))
    await asyncio.sleep(0.01)
    waiter = r.incoming()
    waiter.gone = lambda: True
    second = asyncio.ensure_future(r.pipeline.handle(kind, waiter, _completion()))
    await asyncio.sleep(0.01)
    assert (await r.admission.snapshot())["models"]["m"]["depth"] == 1
    first.cancel()  # the running one's client left first: its slot frees
    with pytest.raises(asyncio.CancelledError):
        await first
    with pytest.raises(ClientGone):
        await second
    assert len(r.path.calls) == 1  # the waiter was granted the slot, and never sent
    assert await r.held() == 0


async def test_a_waiter_whose_client_is_there_is_sent() -> None:
    gate = asyncio.Event()
    r = rig(FakePath(_answer_after(gate)))
    kind = KINDS["/v1/completions"]
    first = asyncio.ensure_future(r.pipeline.handle(kind, r.incoming(), _completion()))
    await asyncio.sleep(0.01)
    waiter = r.incoming()
    waiter.gone = lambda: False
    second = asyncio.ensure_future(r.pipeline.handle(kind, waiter, _completion()))
    await asyncio.sleep(0.01)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    gate.set()
    reply = await second
    assert reply.status == 200 and len(r.path.calls) == 2
    assert reply.after is not None
    await reply.after()
    assert await r.held() == 0
