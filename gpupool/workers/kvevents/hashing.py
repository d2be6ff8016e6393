"""Block hashes as vLLM computes them (``v1/core/kv_cache_utils.py``, ``utils/hashing.py``).

A full block's hash is ``H((parent_hash, tuple(token_ids), extra_keys))``: the first block's
parent is ``NONE_HASH = H(seed)``, where the seed is ``PYTHONHASHSEED`` when the worker's
environment sets it and ``"vllm-none-hash"`` otherwise (for sha256; xxhash then draws a random
seed nobody outside the worker can know). ``extra_keys`` is ``None`` unless the block carries a
LoRA, media or a ``cache_salt`` (first block only: ``(("cache_salt", salt),)`` in vLLM 0.32,
``(salt,)`` in 0.26: ``HashSpec.salt_tagged``, which the worker's own events tell). ``sha256`` is
``hashlib.sha256(pickle.dumps(x, protocol=HIGHEST_PROTOCOL))``; events carry the last 8 bytes as
an int. Only the partial trailing block is never hashed. ``sha256_cbor`` and the xxhash family
need libraries the gateway does not ship: workers using them are routed approximately.
"""

from __future__ import annotations

import hashlib
import pickle
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

DEFAULT_SEED = "vllm-none-hash"
SUPPORTED_ALGOS = frozenset({"sha256"})


@dataclass(slots=True, frozen=True)
class HashSpec:
    """What two workers must share for one request's block hashes to be the same."""

    block_size: int
    algo: str = "sha256"
    seed: str = DEFAULT_SEED
    salt_tagged: bool = True  # vLLM hashes the salt as ``("cache_salt", salt)`` (else bare)


def _sha256(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


@lru_cache(maxsize=64)  # one per seed a pool uses
def none_hash(seed: str) -> bytes:
    return _sha256(seed)


def external(h: bytes) -> int:
    """vLLM's int form of a hash in events (``maybe_convert_block_hash``)."""
    return int.from_bytes(h, "big") & 0xFFFF_FFFF_FFFF_FFFF


def chain(
    parent: bytes, token_ids: list[int], block_size: int, first_extra: tuple[Any, ...] | None
) -> list[bytes]:
    """Full hashes of each full block of ``token_ids`` after ``parent``; ``first_extra``: the
    first block's extra keys."""
    out: list[bytes] = []
    extra = first_extra
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = _sha256((parent, tuple(token_ids[start : start + block_size]), extra))
        out.append(parent)
        extra = None
    return out


def salt_keys(salt: str, tagged: bool = True) -> tuple[Any, ...]:
    """A first block's extra keys for ``salt``: tagged with its source (vLLM 0.32) or bare
    (vLLM 0.26 and the releases before the tags)."""
    return (("cache_salt", salt),) if tagged else (salt,)


def block_hashes(token_ids: list[int], spec: HashSpec, salt: str | None = None) -> list[int]:
    """The int hashes vLLM's events will name for a prompt of ``token_ids`` (full blocks)."""
    if spec.algo not in SUPPORTED_ALGOS:
        raise ValueError(f"hash algorithm {spec.algo} is not supported")
    extra = salt_keys(salt, spec.salt_tagged) if salt else None
    return [external(h) for h in chain(none_hash(spec.seed), token_ids, spec.block_size, extra)]
