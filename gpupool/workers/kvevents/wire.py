"""vLLM's KV-cache event wire format (``vllm/distributed/kv_events.py``), decoded with msgspec.

A message is three frames: ``topic``, an 8-byte big-endian sequence number, and a msgpack
payload: ``[ts, [event, ...], data_parallel_rank]`` where each event is a map tagged by
``"type"`` (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``). Fields this gateway does
not read are ignored, so newer vLLM fields decode too. Block hashes are 64-bit ints by default
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``: the last 8 bytes of the hash) or the hash bytes.
"""

from __future__ import annotations

from typing import Any

import msgspec

Hash = int | bytes


class BlockStored(msgspec.Struct, tag=True):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[list[Any] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: list[Hash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


_DECODER = msgspec.msgpack.Decoder(EventBatch)
END_SEQ = -1  # the replay socket's last message


def decode(payload: bytes) -> EventBatch:
    """One payload; raises ``msgspec.DecodeError`` (or ValidationError) on anything else."""
    return _DECODER.decode(payload)


def seq_of(frame: bytes) -> int:
    return int.from_bytes(frame, "big", signed=True)


def as_int(h: Hash) -> int:
    """A published hash as the index keys it: ints as they are, bytes as vLLM's int form."""
    return h if isinstance(h, int) else int.from_bytes(h, "big") & 0xFFFF_FFFF_FFFF_FFFF


def encode(batch: EventBatch) -> bytes:
    """The payload for ``batch`` (tests and the simulator publish with it)."""
    return msgspec.msgpack.encode(batch)
