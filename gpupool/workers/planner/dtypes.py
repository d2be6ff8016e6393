"""Bytes per element of the dtypes the planner meets: model weights, KV cache, SSM state."""

from __future__ import annotations

from gpupool.workers.planner.errors import PlanArgsError

_DTYPE_BYTES: dict[str, float] = {
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "float32": 4,
    "fp32": 4,
    "float": 4,
}

# vLLM ``--kv-cache-dtype`` values (vllm-behaviour.md §5). fp8 variants store one byte per
# element; nvfp4 stores 4 bits plus one e4m3 scale per 16 elements.
_KV_BYTES: dict[str, float] = {
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8_inc": 1,
    "fp8_ds_mla": 1,
    "nvfp4": 0.5 + 1 / 16,
    "bfloat16": 2,
    "float16": 2,
    "half": 2,
    "float32": 4,
    "float": 4,
}


def dtype_bytes(name: str | None, *, default: float = 2) -> float:
    """Bytes per element of a torch dtype name (``torch.`` prefix allowed), else ``default``."""
    if not name:
        return default
    return _DTYPE_BYTES.get(name.removeprefix("torch.").lower(), default)


def kv_cache_bytes(kv_cache_dtype: str, model_dtype: str) -> tuple[str, float]:
    """The resolved KV cache dtype name and its bytes per element. ``auto``: the model dtype."""
    name = kv_cache_dtype.lower()
    if name == "auto":
        resolved = model_dtype.removeprefix("torch.").lower()
        return resolved, dtype_bytes(resolved)
    if name not in _KV_BYTES:
        known = ", ".join(["auto", *sorted(_KV_BYTES)])
        raise PlanArgsError(
            f"kv-cache-dtype `{kv_cache_dtype}` is not one the planner knows ({known})"
        )
    return name, _KV_BYTES[name]


def state_dtype(requested: str | None, fallback: str) -> tuple[str, float]:
    """An SSM/conv state dtype: ``requested`` unless absent or ``auto``, then ``fallback``."""
    name = fallback if requested in (None, "", "auto") else str(requested)
    name = name.removeprefix("torch.").lower()
    if name not in _DTYPE_BYTES:
        raise PlanArgsError(f"state dtype `{name}` is not one the planner knows")
    return name, _DTYPE_BYTES[name]
