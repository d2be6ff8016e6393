"""The SSE buffer a reshaped stream goes through: an event that arrives in many reads comes out
whole, and each byte is searched for the end of its event once (the count of bytes searched
grows with the stream, not with the stream times its reads)."""

from __future__ import annotations

import itertools
import random

import orjson
import pytest

from gpupool.gateway.transform.sse import EventBuffer, frame

KiB = 1024


def _reads(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


@pytest.mark.parametrize("crlf", [False, True], ids=["lf", "crlf"])
def test_a_large_event_in_many_small_reads_comes_out_whole(crlf: bool) -> None:
    text = "".join(random.Random(7).choices("abc xyz", k=2 * KiB * KiB))
    big = frame({"choices": [{"index": 0, "text": text}]})
    raw = frame({"n": 1}) + big + frame({"n": 2}) + b"data: [DONE]\n\n"
    if crlf:
        raw = raw.replace(b"\n", b"\r\n")
    buf = EventBuffer()
    items: list[bytes] = []
    for n, piece in enumerate(_reads(raw, 100)):  # ~21,000 reads; CRs split from their LFs
        items += buf.events(piece)
        assert len(buf) <= len(big) + 200  # only the event not ended yet is held
        if n == 100:
            assert items == [b'{"n":1}']  # the big one not yet: it has not ended
    assert [orjson.loads(i) for i in items[:3]] == [
        {"n": 1}, {"choices": [{"index": 0, "text": text}]}, {"n": 2}]  # fmt: skip
    assert items[3] == b"[DONE]" and len(buf) == 0
    assert buf.scanned <= len(raw) + len(_reads(raw, 100))  # each byte once (+1 per read)


def test_bytes_searched_grow_with_the_event_not_with_its_reads() -> None:
    """Before: the whole tail searched at every read, 1 MiB in 1 KiB reads ~ 512 MiB."""
    event = b"data: " + b"a" * KiB * KiB
    for size in (KiB, 16, 1):
        buf = EventBuffer(crlf=False)
        reads = _reads(event, size)
        assert all(buf.blocks(r) == [] for r in reads)
        assert buf.blocks(b"\n\n") == [event]
        assert len(event) <= buf.scanned <= len(event) + len(reads) + 2


@pytest.mark.parametrize("cut", range(1, 12))
def test_a_blank_line_split_between_reads_ends_its_event(cut: int) -> None:
    raw = b"data: x\n\ndata: y\n\n"
    buf = EventBuffer(crlf=False)
    assert buf.blocks(raw[:cut]) + buf.blocks(raw[cut:]) == [b"data: x", b"data: y"]


def test_blocks_keep_their_bytes() -> None:
    """``crlf=False`` (event:/data: streams): a block an unreadable event passes on as it came."""
    buf = EventBuffer(crlf=False)
    raw = b"event: a\r\ndata: {}\n\n: ping\n\nevent: b\ndata: 1"
    got = [b for r in _reads(raw, 3) for b in buf.blocks(r)]
    assert got == [b"event: a\r\ndata: {}", b": ping"]
    assert buf.tail() == b"event: b\ndata: 1"


def test_any_read_boundaries_mixed_line_ends() -> None:
    rng = random.Random(3)
    objs = [{"i": i, "t": "x" * rng.randrange(0, 3000)} for i in range(40)]
    ends = [b"\n", b"\r\n", b"\r"]  # one kind per event (CR then LF would be one CRLF)
    raw = b"".join(frame(o).replace(b"\n", rng.choice(ends)) for o in objs) + b"data: [DONE]\n\n"
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(raw)), 300))
        buf = EventBuffer()
        bounds = [0, *cuts, len(raw)]
        items = [i for a, b in itertools.pairwise(bounds) for i in buf.events(raw[a:b])]
        assert [orjson.loads(i) for i in items[:-1]] == objs and items[-1] == b"[DONE]"
