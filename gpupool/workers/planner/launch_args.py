"""Read the memory-relevant vLLM flags out of ``LaunchConfig.args`` into :class:`PlanArgs`.

Keys are accepted as written for the command line (``max-num-seqs``), with underscores
(``max_num_seqs``) or with leading dashes. Sizes take vLLM's human-readable integers: ``32k`` is
32,000 and ``32K`` is 32,768 (lowercase decimal, uppercase binary); ``-1`` or ``auto`` for
``max-model-len`` asks for the longest context that fits.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from gpupool.workers.planner.errors import PlanArgsError
from gpupool.workers.planner.plan import VLLM_DEFAULT_UTILIZATION, PlanArgs

_ALIASES = {"tp": "tensor-parallel-size", "q": "quantization", "dtype-kv": "kv-cache-dtype"}
_HUMAN_INT = re.compile(r"^(\d+(?:\.\d+)?)([kKmMgG]?)$")
_MULTIPLIER = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def normalize_args(args: Mapping[str, Any]) -> dict[str, Any]:
    """``{"max_num_seqs": 4}`` → ``{"max-num-seqs": 4}``; aliases resolved."""
    out: dict[str, Any] = {}
    for key, value in args.items():
        name = str(key).lstrip("-").replace("_", "-")
        out[_ALIASES.get(name, name)] = value
    return out


def human_int(value: Any, flag: str) -> int:
    if isinstance(value, bool):
        raise PlanArgsError(f"{flag}: expected an integer, got {value!r}")
    if isinstance(value, int):
        return value
    text = str(value).strip()
    if text.lstrip("-").isdigit():
        return int(text)
    match = _HUMAN_INT.match(text)
    if match is None:
        raise PlanArgsError(f"{flag}: expected an integer such as 32768 or 32k, got {value!r}")
    return int(float(match.group(1)) * _MULTIPLIER[match.group(2)])


def _float(value: Any, flag: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise PlanArgsError(f"{flag}: expected a number, got {value!r}") from None


def _flag(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() not in ("false", "0", "no", "off")
    return bool(value)


def _opt_str(value: Any) -> str | None:
    return None if value is None else str(value)


def _max_model_len(value: Any) -> int | None:
    if value is None:
        return None
    if str(value).strip().lower() == "auto":
        return -1
    return human_int(value, "max-model-len")


def _mtp(value: Any) -> bool:
    """Whether ``--speculative-config`` asks for MTP (which loads the MTP weights)."""
    if value is None:
        return False
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return "mtp" in value.lower()
    return isinstance(value, dict) and "mtp" in str(value.get("method", "")).lower()


def _opt_int(a: Mapping[str, Any], flag: str) -> int | None:
    value = a.get(flag)
    return None if value is None else human_int(value, flag)


def utilization(args: Mapping[str, Any]) -> float:
    """``gpu-memory-utilization`` of normalized ``args`` (vLLM's default when absent)."""
    util = args.get("gpu-memory-utilization")
    return VLLM_DEFAULT_UTILIZATION if util is None else _float(util, "gpu-memory-utilization")


def tensor_parallel_size(args: Mapping[str, Any]) -> int:
    return _opt_int(args, "tensor-parallel-size") or 1


def plan_args_from_launch(
    args: Mapping[str, Any],
    gpu_memory_bytes: int,
    overrides: Mapping[str, Any] | None = None,
    *,
    overhead_fraction: float | None = None,
    triton_cache_warmed: bool = False,
) -> PlanArgs:
    """:class:`PlanArgs` from a launch's ``args`` (``overrides`` win, same key rules)."""
    a = normalize_args({**normalize_args(args), **normalize_args(overrides or {})})
    prefix = a.get("enable-prefix-caching", True)
    return PlanArgs(
        gpu_memory_bytes=gpu_memory_bytes,
        gpu_memory_utilization=utilization(a),
        tensor_parallel_size=tensor_parallel_size(a),
        max_model_len=_max_model_len(a.get("max-model-len")),
        max_num_seqs=_opt_int(a, "max-num-seqs"),
        max_num_batched_tokens=_opt_int(a, "max-num-batched-tokens"),
        kv_cache_dtype=str(a.get("kv-cache-dtype") or "auto"),
        quantization=_opt_str(a.get("quantization")),
        block_size=_opt_int(a, "block-size"),
        enforce_eager=_flag(a.get("enforce-eager", False)),
        enable_prefix_caching=_flag(prefix) and not _flag(a.get("no-enable-prefix-caching", False)),
        moe_backend=_opt_str(a.get("moe-backend")),
        mtp=_mtp(a.get("speculative-config")),
        mamba_cache_dtype=_opt_str(a.get("mamba-cache-dtype")),
        mamba_ssm_cache_dtype=_opt_str(a.get("mamba-ssm-cache-dtype")),
        overhead_fraction=overhead_fraction,
        triton_cache_warmed=triton_cache_warmed,
    )
