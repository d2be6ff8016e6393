"""A client that stops reading is cut after ``server.write_timeout_s`` without progress.

A reply is written into the connection's buffers; once they are full (the kernel's send queue,
then the transport's own past its high-water mark) the transport pauses the protocol, and every
write after that waits for the client to read (``FlowControl.drain``, the lane's and uvicorn's
alike). A client that keeps its socket open and never reads would make that wait endless, and
the request's worker slot, its key's concurrency slot and the worker's capacity with it (a swap
group could never put that worker to sleep). Idle timeouts do not help: the worker keeps the
stream busy.

:class:`WriteStall` arms one timer per connection while its writes are paused (none while they
are not, so a request that never fills the buffers pays nothing). Each tick it compares what the
client has not yet taken, the transport's buffer plus the kernel's send queue (``SIOCOUTQ``:
bytes not yet acknowledged, so a read shows as soon as the client's window opens); any decrease
is progress. A slow but steady reader makes progress and is never cut, however long its reply;
one that takes nothing for ``limit_s`` is cut: the connection is reset (``SO_LINGER`` 0, so
neither the buffer nor the kernel's queue is kept for a client that will not read it), and the
protocol's disconnect does the rest as for any client that leaves (the request's task is
cancelled, its worker connection closed, so vLLM aborts it, and its exchange gives everything
back once). The same as nginx's ``send_timeout`` with ``reset_timedout_connection``.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import socket
import struct
import termios
from collections.abc import Callable

_TICKS = 4  # checks per ``limit_s``: a client is cut between ``limit_s`` and 1.25 x it
_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close with a reset, drop what is queued


class WriteStall:
    """One connection's watch on its paused writes; ``on_stall`` runs once progress stops for
    ``limit_s`` (the caller then cuts the connection, :func:`reset`)."""

    __slots__ = ("_last", "_loop", "_on_stall", "_seen", "_timer", "_transport", "limit_s")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        transport: asyncio.Transport,
        limit_s: float,
        on_stall: Callable[[], None],
    ) -> None:
        self._loop = loop
        self._transport = transport
        self.limit_s = limit_s
        self._on_stall = on_stall
        self._timer: asyncio.TimerHandle | None = None
        self._seen = 0  # bytes the client had not taken at the last look
        self._last = 0.0  # when the client last took some

    def paused(self) -> None:
        """The transport paused writing: start watching (if not already)."""
        if self._timer is None:
            self._seen = unsent(self._transport)
            self._last = self._loop.time()
            self._timer = self._loop.call_later(self.limit_s / _TICKS, self._check)

    def resumed(self) -> None:
        """Writing resumed, or the connection went: stop watching."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check(self) -> None:
        self._timer = None
        now, left = self._loop.time(), unsent(self._transport)
        if left < self._seen:
            self._last = now
        self._seen = left  # a write made while paused (a pipelined reply) is no stall
        remaining = self._last + self.limit_s - now
        if remaining <= 0.001:
            self._on_stall()
        else:
            wait = min(self.limit_s / _TICKS, remaining)
            self._timer = self._loop.call_later(wait, self._check)


def unsent(transport: asyncio.Transport) -> int:
    """Bytes written to ``transport`` that its client has not taken: the transport's buffer
    and, for a socket, the kernel's send queue (0 where it cannot be read)."""
    left = transport.get_write_buffer_size()
    fd = _fd(transport)
    if fd is not None:
        with contextlib.suppress(OSError):
            queued = fcntl.ioctl(fd, termios.TIOCOUTQ, b"\0\0\0\0")  # = SIOCOUTQ
            left += struct.unpack("i", queued)[0]
    return left


def reset(transport: asyncio.Transport) -> None:
    """Close ``transport`` at once with a reset: its buffer and the kernel's queue dropped."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError, AttributeError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
    transport.abort()


def _fd(transport: asyncio.Transport) -> int | None:
    sock = transport.get_extra_info("socket")
    if sock is None:
        return None
    with contextlib.suppress(OSError, AttributeError):
        fd = sock.fileno()
        return fd if isinstance(fd, int) and fd >= 0 else None
    return None
