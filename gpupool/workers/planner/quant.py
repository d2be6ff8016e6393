"""Weight quantization: which precision each component is stored in.

The scheme comes from the checkpoint's ``quantization_config`` when it has one (what is on disk
wins), else from ``--quantization`` (``fp8``/``int8`` are quantized online by vLLM; ``awq``,
``gptq``, ``int4``, ``nvfp4`` plan "as if" a checkpoint in that format were used).

Bytes per parameter, scales included:

- bf16/fp16: 2. fp8 and int8: 1 (per-channel or 128x128 block scales add < 0.1 %).
- int4 (AWQ/GPTQ/compressed-tensors pack-quantized), group g: 0.5 + 2/g for an fp16 scale per
  group, + 0.5/g when 4-bit zero points are stored (asymmetric AWQ, GPTQ qzeros). g=128: ~0.52.
- NVFP4: 0.5 + 1/16 (one e4m3 scale per 16 weights; the fp32 tensor scale is negligible): 0.5625.
- MXFP4: 0.5 + 1/32 (one e8m0 scale per 32 weights): 0.53125.

Checkpoints keep some modules unquantized (``ignore``, ``exclude_modules``,
``modules_to_not_convert``); those entries are mapped to components by name (``linear_attn``,
``self_attn``, ``experts``, ``visual``...). Entries naming only the tiny GDN parts
(``in_proj_a``/``in_proj_b``, conv1d, norms) do not move a whole component to bf16.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpupool.workers.planner.errors import PlanArgsError
from gpupool.workers.planner.findings import Finding, warning
from gpupool.workers.planner.model_spec import ModelSpec
from gpupool.workers.planner.params import Component


@dataclass(frozen=True, slots=True)
class Precision:
    name: str
    bytes_per_param: float


FP8 = Precision("fp8", 1.0)
INT8 = Precision("int8", 1.0)
NVFP4 = Precision("nvfp4", 0.5 + 1 / 16)
MXFP4 = Precision("mxfp4", 0.5 + 1 / 32)
NF4 = Precision("nf4", 0.5 + 1 / 32)  # bitsandbytes 4-bit with double-quantized absmax

QUANTIZABLE = frozenset(
    {
        Component.attention,
        Component.linear_attention,
        Component.mlp,
        Component.experts,
        Component.shared_experts,
        Component.mtp,
    }
)


def int_precision(bits: int, group_size: int, *, zero_point: bool) -> Precision:
    if bits == 8:
        return INT8
    if group_size <= 0:  # per-channel scales
        return Precision(f"int{bits}", bits / 8)
    extra = (2 + (bits / 8 if zero_point else 0)) / group_size
    return Precision(f"int{bits}-g{group_size}", bits / 8 + extra)


@dataclass(frozen=True, slots=True)
class QuantScheme:
    method: str  # "none", "fp8", "awq", "gptq", "compressed-tensors", "modelopt", ...
    precision: Precision | None  # of the components in ``quantized``
    quantized: frozenset[Component] = QUANTIZABLE
    overrides: Mapping[Component, Precision] = field(default_factory=dict)
    source: str = "none"  # "checkpoint", "--quantization" or "none"

    def precision_of(self, component: Component, model_dtype: Precision) -> Precision:
        if component in self.overrides:
            return self.overrides[component]
        if self.precision is not None and component in self.quantized:
            return self.precision
        return model_dtype

    @property
    def label(self) -> str:
        if self.method == "none":
            return "none (model dtype)"
        kinds = sorted({p.name for p in (self.precision, *self.overrides.values()) if p})
        return f"{self.method} {'+'.join(kinds)} ({self.source})"


NO_QUANT = QuantScheme("none", None, frozenset())

_FAMILY = {
    "awq_marlin": "awq",
    "gptq_marlin": "gptq",
    "modelopt_fp4": "modelopt",
    "modelopt_mixed": "modelopt",
    "fbgemm_fp8": "fp8",
}

_NO_QUANT_NAMES = frozenset({"none", "auto", "bf16", "bfloat16", "fp16", "float16"})


def resolve_scheme(spec: ModelSpec, requested: str | None) -> tuple[QuantScheme, list[Finding]]:
    """The weights' scheme, and a warning when ``requested`` contradicts the checkpoint."""
    req = requested.lower() if requested else None
    if spec.quantization_config is None:
        return requested_scheme(req), []
    scheme = checkpoint_scheme(spec.quantization_config)
    if req is None or _family(req) == _family(scheme.method):
        return scheme, []
    message = (
        f"the checkpoint is quantized with `{scheme.method}` (quantization_config); vLLM "
        f"refuses a different --quantization (`{requested}`) unless it is a compatible "
        "kernel choice; the planner uses the checkpoint's scheme"
    )
    return scheme, [warning("args.quantization", message)]


def _family(method: str) -> str:
    return _FAMILY.get(method, method)


def requested_scheme(req: str | None) -> QuantScheme:
    """A scheme for ``--quantization`` when the checkpoint has no ``quantization_config``."""
    if req is None or req in _NO_QUANT_NAMES:
        return NO_QUANT
    made = _REQUESTED.get(req)
    if made is None:
        if req in _CHECKPOINT_PARSERS:
            raise PlanArgsError(
                f"--quantization {req} reads its format from the checkpoint's "
                "quantization_config, which this config.json does not have"
            )
        known = ", ".join(sorted({*_REQUESTED, *_NO_QUANT_NAMES}))
        raise PlanArgsError(f"--quantization `{req}` is not one the planner knows ({known})")
    return made(req)


def _online(
    precision: Precision, components: frozenset[Component] = QUANTIZABLE
) -> Callable[[str], QuantScheme]:
    return lambda req: QuantScheme(req, precision, components, source="--quantization")


_INT4 = int_precision(4, 128, zero_point=True)
_REQUESTED: dict[str, Callable[[str], QuantScheme]] = {
    "fp8": _online(FP8),
    "fbgemm_fp8": _online(FP8),
    "int8": _online(INT8),
    "bitsandbytes": _online(INT8),
    "experts_int8": _online(INT8, frozenset({Component.experts})),
    "awq": _online(_INT4),
    "awq_marlin": _online(_INT4),
    "gptq": _online(_INT4),
    "gptq_marlin": _online(_INT4),
    "int4": _online(_INT4),
    "nvfp4": _online(NVFP4),
    "modelopt_fp4": _online(NVFP4),
    "mxfp4": _online(MXFP4, frozenset({Component.experts})),
}


def checkpoint_scheme(q: Mapping[str, Any]) -> QuantScheme:
    method = str(q.get("quant_method", "")).lower()
    parse = _CHECKPOINT_PARSERS.get(method)
    if parse is None:
        known = ", ".join(sorted(_CHECKPOINT_PARSERS))
        raise PlanArgsError(
            f"quantization_config.quant_method `{method}` is not one the planner knows ({known}); "
            "pass --quantization to say what precision the weights are in"
        )
    precision, quantized, overrides = parse(q)
    excluded = components_named(_exclusions(q))  # these stay in the model dtype
    kept = {c: p for c, p in overrides.items() if c not in excluded}
    return QuantScheme(method, precision, quantized - excluded, kept, "checkpoint")


Parsed = tuple[Precision | None, frozenset[Component], dict[Component, Precision]]


def _fp8(q: Mapping[str, Any]) -> Parsed:
    return FP8, QUANTIZABLE, {}


def _awq(q: Mapping[str, Any]) -> Parsed:
    bits = int(q.get("bits", q.get("w_bit", 4)))
    group = int(q.get("group_size", q.get("q_group_size", 128)))
    return int_precision(bits, group, zero_point=bool(q.get("zero_point", True))), QUANTIZABLE, {}


def _gptq(q: Mapping[str, Any]) -> Parsed:
    bits = int(q.get("bits", 4))
    return int_precision(bits, int(q.get("group_size", 128)), zero_point=True), QUANTIZABLE, {}


def _compressed_tensors(q: Mapping[str, Any]) -> Parsed:
    groups = q.get("config_groups")
    first: Mapping[str, Any] = next(iter(groups.values()), {}) if isinstance(groups, dict) else {}
    weights = first.get("weights") or {}
    return _weight_precision(weights), QUANTIZABLE, {}


def _weight_precision(w: Mapping[str, Any]) -> Precision:
    bits = int(w.get("num_bits", 8))
    is_float = w.get("type", "int") == "float"
    group = int(w.get("group_size") or 0)
    if bits == 4 and is_float:
        return NVFP4 if group in (0, 16) else MXFP4
    if bits == 8:
        return FP8 if is_float else INT8
    return int_precision(bits, group, zero_point=not w.get("symmetric", True))


def _modelopt(q: Mapping[str, Any]) -> Parsed:
    algo = str(q.get("quant_algo", "")).upper()
    if algo == "MIXED_PRECISION":
        return None, frozenset(), _mixed_overrides(q.get("quantized_layers") or {})
    return _ALGO.get(algo, NVFP4), QUANTIZABLE, {}


_ALGO = {"FP8": FP8, "NVFP4": NVFP4, "W4A8_AWQ": int_precision(4, 128, zero_point=False)}


def _mixed_overrides(layers: Mapping[str, Any]) -> dict[Component, Precision]:
    out: dict[Component, Precision] = {}
    for name, cfg in layers.items():
        component = component_of(name)
        algo = str(cfg.get("quant_algo", "")).upper() if isinstance(cfg, dict) else ""
        if component is not None and algo in _ALGO:
            out.setdefault(component, _ALGO[algo])
    return out


def _modelopt_fp4(q: Mapping[str, Any]) -> Parsed:
    return NVFP4, QUANTIZABLE, {}


def _mxfp4(q: Mapping[str, Any]) -> Parsed:
    return MXFP4, frozenset({Component.experts}), {}


def _bitsandbytes(q: Mapping[str, Any]) -> Parsed:
    return (NF4 if q.get("load_in_4bit") else INT8), QUANTIZABLE, {}


_CHECKPOINT_PARSERS: dict[str, Callable[[Mapping[str, Any]], Parsed]] = {
    "fp8": _fp8,
    "fbgemm_fp8": _fp8,
    "awq": _awq,
    "awq_marlin": _awq,
    "gptq": _gptq,
    "gptq_marlin": _gptq,
    "compressed-tensors": _compressed_tensors,
    "modelopt": _modelopt,
    "modelopt_fp4": _modelopt_fp4,
    "mxfp4": _mxfp4,
    "bitsandbytes": _bitsandbytes,
}


def _exclusions(q: Mapping[str, Any]) -> list[str]:
    out: list[str] = []
    for key in ("ignore", "exclude_modules", "modules_to_not_convert", "ignored_layers"):
        value = q.get(key)
        if isinstance(value, list):
            out.extend(str(v) for v in value)
    return out


# Ordered: the first rule whose text occurs in a module name decides its component.
# ``None``: a tiny part (GDN gates, conv, norms) whose precision does not matter.
_NAME_RULES: tuple[tuple[str, Component | None], ...] = (
    ("mtp", Component.mtp),
    ("visual", Component.vision),
    ("vision", Component.vision),
    ("lm_head", Component.lm_head),
    ("embed", Component.embed),
    ("in_proj_a", None),
    ("in_proj_b", None),
    ("conv1d", None),
    ("a_log", None),
    ("dt_bias", None),
    ("norm", None),
    ("shared_expert_gate", Component.router),
    ("linear_attn", Component.linear_attention),
    ("self_attn", Component.attention),
    ("shared_expert", Component.shared_experts),
    ("experts", Component.experts),
    ("gate_proj", Component.mlp),
    ("up_proj", Component.mlp),
    ("down_proj", Component.mlp),
    ("mlp.gate", Component.router),
    ("router", Component.router),
    ("mlp", Component.mlp),
)


def component_of(module_name: str) -> Component | None:
    name = module_name.removeprefix("re:").lower()
    return next((c for text, c in _NAME_RULES if text in name), None)


def components_named(names: list[str]) -> frozenset[Component]:
    return frozenset(c for n in names if (c := component_of(n)) is not None)
