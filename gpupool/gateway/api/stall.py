"""A client that stops reading, or reads too little, is cut after ``server.write_timeout_s``.

A reply is written into the connection's buffers; once they are full (the kernel's send queue,
then the transport's own past its high-water mark) the transport pauses the protocol, and every
write after that waits for the client to read (``FlowControl.drain``, the lane's and uvicorn's
alike). A client that keeps its socket open and never reads would make that wait endless, and
the request's worker slot, its key's concurrency slot and the worker's capacity with it (a swap
group could never put that worker to sleep). Idle timeouts do not help: the worker keeps the
stream busy. Nor does "any progress": a client that takes one TCP segment every few seconds
(a hundred bytes a second) holds all of that for hours.

:class:`WriteStall` arms one timer per connection while its writes are paused (none while they
are not, so a request that never fills the buffers pays nothing). Every quarter of ``limit_s``
it counts the bytes the client took since: TCP's ``tcpi_bytes_acked`` where there is one (exact,
whatever the gateway writes meanwhile), else the decrease of what the client has not yet taken,
the transport's buffer plus the kernel's send queue (``SIOCOUTQ``). Once paused for ``limit_s``,
a client that took fewer than ``min_bytes`` in the last ``limit_s`` (``server.write_min_bytes``,
a floor far below any real reader on a slow link) is cut: the connection is reset (``SO_LINGER``
0, so neither the buffer nor the kernel's queue is kept for a client that will not read it), and
the protocol's disconnect does the rest as for any client that leaves (the request's task is
cancelled, its worker connection closed, so vLLM aborts it, and its exchange gives everything
back once). nginx's ``send_timeout`` with ``reset_timedout_connection`` (which any byte
satisfies), plus a minimum rate, as Apache's ``mod_reqtimeout`` ``MinRate`` keeps for bodies.

A pause ends when the client has taken enough for the transport's buffer to drop below its
low-water mark (tens of KiB, more than ``min_bytes`` on any sensible setting); the next pause
starts a fresh window.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import socket
import struct
import termios
from collections import deque
from collections.abc import Callable

_TICKS = 4  # looks per ``limit_s``: a client is cut between ``limit_s`` and 1.25 x it
_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close with a reset, drop what is queued
# ``struct tcp_info``: ``tcpi_bytes_acked`` (u64, Linux 4.1+) sits after 8 one-byte fields,
# 24 u32 and 2 u64 (pacing rates)
_ACKED_AT = 8 + 24 * 4 + 2 * 8
_TCP_INFO_LEN = 256


class WriteStall:
    """One connection's watch on its paused writes; ``on_stall`` runs once the client took
    fewer than ``min_bytes`` in ``limit_s`` (the caller then cuts the connection, :func:`reset`)."""

    __slots__ = ("_loop", "_marks", "_on_stall", "_seen", "_taken", "_timer", "_transport",
                 "limit_s", "min_bytes")  # fmt: skip

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        transport: asyncio.Transport,
        limit_s: float,
        on_stall: Callable[[], None],
        min_bytes: int = 1,
    ) -> None:
        self._loop = loop
        self._transport = transport
        self.limit_s = limit_s
        self.min_bytes = min_bytes
        self._on_stall = on_stall
        self._timer: asyncio.TimerHandle | None = None
        self._seen = 0  # the last look: bytes acked (TCP), else bytes the client had not taken
        self._taken = 0  # bytes the client took since the pause began
        # ``_taken`` at each of the last looks, the pause's start first: the window's count
        self._marks: deque[int] = deque(maxlen=_TICKS + 1)

    def paused(self) -> None:
        """The transport paused writing: start watching (if not already)."""
        if self._timer is None:
            acked = bytes_acked(self._transport)
            self._seen = unsent(self._transport) if acked is None else acked
            self._taken = 0
            self._marks.clear()
            self._marks.append(0)
            self._timer = self._loop.call_later(self.limit_s / _TICKS, self._check)

    def resumed(self) -> None:
        """Writing resumed, or the connection went: stop watching."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check(self) -> None:
        self._timer = None
        self._taken += self._took()
        self._marks.append(self._taken)
        # a window is the last ``_TICKS`` looks; a late look (a busy loop) only widens it
        if len(self._marks) > _TICKS and self._marks[-1] - self._marks[0] < self.min_bytes:
            self._on_stall()
        else:
            self._timer = self._loop.call_later(self.limit_s / _TICKS, self._check)

    def _took(self) -> int:
        """Bytes the client took since the last look."""
        acked = bytes_acked(self._transport)
        if acked is not None:
            took, self._seen = acked - self._seen, acked
            return max(took, 0)
        left = unsent(self._transport)
        # a write made while paused (a pipelined reply) hides what was taken meanwhile: it
        # counts as nothing, never as a negative
        took, self._seen = self._seen - left, left
        return max(took, 0)


def bytes_acked(transport: asyncio.Transport) -> int | None:
    """The bytes of ``transport``'s TCP connection its client has acknowledged (taken into its
    receive buffer, which only empties as it reads); None where that cannot be read."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
    except (OSError, AttributeError):
        return None  # not TCP (a Unix socket), or no TCP_INFO here
    if len(info) < _ACKED_AT + 8:
        return None  # a kernel older than the field
    acked: int = struct.unpack_from("Q", info, _ACKED_AT)[0]
    return acked


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
