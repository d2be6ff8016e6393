"""Find a model's ``config.json`` the way vLLM does, without ever touching its weights.

In order, the first that works:

1. a local directory (or file) — ``/models/Qwen3.5-27B``, ``./config.json``;
2. the local Hugging Face cache, for a repo id (``Qwen/Qwen3.5-27B``): ``HF_HUB_CACHE``, else
   ``HF_HOME/hub``, else ``~/.cache/huggingface/hub`` — where ``vllm serve`` downloaded it;
3. the Hub, unless ``HF_HUB_OFFLINE`` is set: ``config.json`` only (and ModelOpt's
   ``hf_quant_config.json`` when the config has no ``quantization_config``), into that cache;
4. a built-in shape (:mod:`gpupool.workers.planner.shapes`), said so in ``source``.

When none works, :class:`ModelNotFoundError` names each step tried and why it failed.
The Hub is reached through :class:`HubFiles`, so tests use a fake cache or a fake download.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from gpupool.workers.planner.errors import ModelConfigError, ModelNotFoundError
from gpupool.workers.planner.model_spec import ModelSpec, load_model_spec, parse_model_spec
from gpupool.workers.planner.shapes import builtin_shape, known_names

CONFIG = "config.json"
QUANT_CONFIG = "hf_quant_config.json"
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
HUB_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    spec: ModelSpec
    source: str  # where the config came from, for the output
    builtin: bool = False
    reasoning_parser: str | None = None  # vLLM's --reasoning-parser for this family


class HubFiles(Protocol):
    """The two Hugging Face Hub operations resolution needs."""

    def cached(self, repo_id: str, filename: str) -> Path | None: ...
    def download(self, repo_id: str, filename: str) -> Path | None:
        """The file, fetched into the cache; None when the repo has no such file."""
        ...


def hub_cache_dir() -> Path:
    """``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub``."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME")
    if not home:
        xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        home = str(Path(xdg) / "huggingface")
    return Path(home).expanduser() / "hub"


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


@dataclass
class HuggingFaceHub:
    """:class:`HubFiles` over ``huggingface_hub``, reading the environment at each call."""

    timeout_s: float = HUB_TIMEOUT_S

    def cached(self, repo_id: str, filename: str) -> Path | None:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo_id, filename, cache_dir=hub_cache_dir())
        return Path(found) if isinstance(found, str) else None

    def download(self, repo_id: str, filename: str) -> Path | None:
        from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url
        from huggingface_hub.errors import RemoteEntryNotFoundError

        endpoint = os.environ.get("HF_ENDPOINT") or None  # read now, not at import
        url = hf_hub_url(repo_id, filename, endpoint=endpoint)
        try:  # one HEAD without retries: hf_hub_download backs off for ~25 s when offline
            get_hf_file_metadata(url, timeout=self.timeout_s, endpoint=endpoint)
        except RemoteEntryNotFoundError:
            return None
        path = hf_hub_download(
            repo_id,
            filename,
            cache_dir=hub_cache_dir(),
            etag_timeout=self.timeout_s,
            endpoint=endpoint,
        )
        return Path(path)


@dataclass
class _Attempts:
    tried: list[str] = field(default_factory=list)

    def add(self, step: str) -> None:
        self.tried.append(step)


def resolve_model(
    ref: str, *, hint: str | None = None, hub: HubFiles | None = None
) -> ResolvedModel:
    """``ref`` (a path or a repo id) → its spec. ``hint`` (e.g. the served model name) is
    also tried against the built-in shapes. Raises :class:`ModelNotFoundError`."""
    attempts = _Attempts()
    found = _local(ref, attempts)
    if found is None and REPO_ID.match(ref) and not Path(ref).expanduser().exists():
        found = _from_hub(ref, hub or HuggingFaceHub(), attempts)
    if found is None:
        found = _builtin(ref, hint, attempts)
    if found is None:
        raise ModelNotFoundError(_not_found(ref, attempts))
    if found.reasoning_parser is None:
        found = replace(found, reasoning_parser=reasoning_parser_of(found.spec))
    return found


def _local(ref: str, attempts: _Attempts) -> ResolvedModel | None:
    path = Path(ref).expanduser()
    file = path / CONFIG if path.is_dir() else path
    if file.is_file():
        return ResolvedModel(load_model_spec(file), f"local {file}")
    if path.is_dir():
        attempts.add(f"local directory {path}: no {CONFIG}")
    elif not REPO_ID.match(ref):
        attempts.add(f"local path {path}: does not exist")
    return None


def _from_hub(repo_id: str, hub: HubFiles, attempts: _Attempts) -> ResolvedModel | None:
    cache = hub_cache_dir()
    try:
        path = hub.cached(repo_id, CONFIG)
    except Exception as e:  # a corrupt cache must not stop the other steps
        attempts.add(f"Hugging Face cache {cache}: {_reason(e)}")
        path = None
    if path is not None:
        return _hub_spec(repo_id, path, hub, f"Hugging Face cache ({path})", online=False)
    attempts.add(f"Hugging Face cache {cache}: no {repo_id} {CONFIG}")
    if hub_offline():
        attempts.add("the Hub: not asked, HF_HUB_OFFLINE is set")
        return None
    try:
        path = hub.download(repo_id, CONFIG)
    except Exception as e:  # network, auth, unknown repo: each a reason to fall back
        attempts.add(f"the Hub ({CONFIG} only): {_reason(e)}")
        return None
    if path is None:
        attempts.add(f"the Hub: {repo_id} has no {CONFIG}")
        return None
    return _hub_spec(repo_id, path, hub, f"the Hub, {CONFIG} only ({path})", online=True)


def _hub_spec(
    repo_id: str, path: Path, hub: HubFiles, source: str, *, online: bool
) -> ResolvedModel:
    data = _read_json(path)
    if isinstance(data, dict) and "quantization_config" not in data:
        quant = _modelopt_quant_config(repo_id, hub, online=online)
        if quant is not None:
            data["quantization_config"] = quant
    spec = parse_model_spec(data, name=repo_id)
    return ResolvedModel(spec, source, reasoning_parser=reasoning_parser_of(spec))


def _modelopt_quant_config(repo_id: str, hub: HubFiles, *, online: bool) -> dict[str, Any] | None:
    """vLLM reads ModelOpt checkpoints' format from ``hf_quant_config.json``."""
    try:
        path = hub.cached(repo_id, QUANT_CONFIG)
        if path is None and online:
            path = hub.download(repo_id, QUANT_CONFIG)
    except Exception:
        return None  # optional file: a failure here leaves the weights unquantized
    data = _read_json(path) if path is not None else None
    quant = data.get("quantization") if isinstance(data, dict) else None
    return {"quant_method": "modelopt", **quant} if isinstance(quant, dict) else None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ModelConfigError(f"{path}: cannot read: {e.strerror}") from None
    except ValueError as e:
        raise ModelConfigError(f"{path}: not valid JSON: {e}") from None


def _builtin(ref: str, hint: str | None, attempts: _Attempts) -> ResolvedModel | None:
    for name in dict.fromkeys(n for n in (ref, hint) if n):
        shape = builtin_shape(name)
        if shape is not None:
            spec = replace(parse_model_spec(shape.config, name=ref), name=ref)
            return ResolvedModel(spec, shape.label, True, shape.reasoning_parser)
    attempts.add(f"built-in shapes: none for `{ref}` (known: {', '.join(known_names())})")
    return None


_THINKING_FAMILIES = ("qwen3_5", "qwen3_next")


def reasoning_parser_of(spec: ModelSpec) -> str | None:
    """vLLM's ``--reasoning-parser`` for a model family that thinks by default."""
    return "qwen3" if spec.model_type.startswith(_THINKING_FAMILIES) else None


def _reason(e: Exception) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}"[:200]


def _not_found(ref: str, attempts: _Attempts) -> str:
    steps = "\n".join(f"  - {t}" for t in attempts.tried)
    return (
        f"no config.json for `{ref}`; tried:\n{steps}\n"
        "give a local model directory, run once online (only config.json is fetched), "
        "or pass --model-config"
    )
