"""Built-in model shapes: the ``config.json`` facts of the models the seeds deploy.

Used when a model can be read neither from a local directory, nor from the Hugging Face cache,
nor from the Hub (offline, or no network), so that ``gpupool plan``/``check``/``init`` still
know the Qwen3.5 family (0.8B ... 397B-A17B), Qwen3.6-35B-A3B and their common quantized
checkpoints (FP8, AWQ 4-bit, NVFP4). One JSON file per base model (``config`` is what the
planner reads of its ``config.json``, ``source`` says where each number comes from), and
``quantization.json`` holds the ``quantization_config`` of each quantized format.

A reference matches a shape by its last path component, case-insensitively:

- a known repository (``cyankiwi/Qwen3.5-35B-A3B-AWQ-4bit``, ``/data/models/Qwen3.5-27B``);
- else a base name followed by a suffix naming the format (``someone/Qwen3.5-27B-AWQ`` → the
  27B with the AWQ template; ``fp8``, ``awq``/``int4``/``4bit``/``gptq``, ``nvfp4``/``fp4``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any


@dataclass(frozen=True, slots=True)
class BuiltinShape:
    name: str  # "Qwen3.5-35B-A3B"
    quantization: str | None  # a key of quantization.json, None for the bf16 checkpoint
    config: dict[str, Any]  # a config.json, quantization_config included
    reasoning_parser: str | None
    source: str

    @property
    def label(self) -> str:
        suffix = f" + {self.quantization} template" if self.quantization else ""
        return f"built-in shape {self.name}{suffix}"


_SUFFIXES = (
    ("nvfp4", "nvfp4"),
    ("fp4", "nvfp4"),
    ("fp8", "fp8"),
    ("awq", "awq"),
    ("gptq", "awq"),
    ("int4", "awq"),
    ("4bit", "awq"),
)


def builtin_shape(ref: str) -> BuiltinShape | None:
    """The built-in shape ``ref`` names, or None."""
    name = _last_part(ref)
    if not name:
        return None
    for base, doc in _shapes().items():
        if name in _known(doc) or name == base:
            return _make(doc, _variant_scheme(doc, name))
    key = _base_key(name)
    if key is None:
        return None
    rest = name[len(key) :]
    return _make(_shapes()[key], next((s for word, s in _SUFFIXES if word in rest), None))


def known_names() -> list[str]:
    """Every base model with a built-in shape (for error messages)."""
    return sorted(doc["name"] for doc in _shapes().values())


def _last_part(ref: str) -> str:
    return ref.strip().rstrip("/").rsplit("/", 1)[-1].lower()


def _known(doc: dict[str, Any]) -> set[str]:
    repos = [*doc["repos"], *(v["repo"] for v in doc["quantized_variants"])]
    return {_last_part(r) for r in repos}


def _variant_scheme(doc: dict[str, Any], name: str) -> str | None:
    for v in doc["quantized_variants"]:
        if _last_part(v["repo"]) == name:
            return str(v["quantization"])
    return None


def _base_key(name: str) -> str | None:
    matches = [k for k in _shapes() if re.match(re.escape(k) + r"($|[-_.])", name)]
    return max(matches, key=len) if matches else None


def _make(doc: dict[str, Any], scheme: str | None) -> BuiltinShape:
    config = json.loads(json.dumps(doc["config"]))  # a private copy
    if scheme is not None:
        config["quantization_config"] = _quantization()[scheme]["quantization_config"]
    return BuiltinShape(
        name=doc["name"],
        quantization=scheme,
        config=config,
        reasoning_parser=doc.get("reasoning_parser"),
        source=doc["source"],
    )


@cache
def _shapes() -> dict[str, dict[str, Any]]:
    files = resources.files(__package__)
    out: dict[str, dict[str, Any]] = {}
    for f in files.iterdir():
        if f.name.endswith(".json") and f.name != "quantization.json":
            out[f.name.removesuffix(".json")] = json.loads(f.read_text(encoding="utf-8"))
    return out


@cache
def _quantization() -> dict[str, dict[str, Any]]:
    text = resources.files(__package__).joinpath("quantization.json").read_text(encoding="utf-8")
    data: dict[str, dict[str, Any]] = json.loads(text)
    return data
