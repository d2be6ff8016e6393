"""Pure translation of a worker's ``launch:`` section into argv, environment and limits.

Nothing here does I/O: the functions read configuration (and, for ``build_env``, the inherited
environment) and return values, so the exact command a user will get is testable on its own.

``args`` become flags in order: ``key: value`` → ``--key value``; ``true`` → ``--key``;
``false``/``null`` → omitted; mappings and lists → one JSON argument
(``--limit-mm-per-prompt '{"image": 2, "video": 0}'``). gpupool then appends
``--host 127.0.0.1 --port N --served-model-name <model>`` itself: the gateway is the only
public endpoint and routes by that name, so users may not set those flags (``check_launch``).

The worker's model adds vLLM's own flags unless ``args`` name them (any value; ``false``
drops the flag): ``reasoning: qwen3`` → ``--reasoning-parser qwen3`` (the worker splits, so
structured outputs and tools compose with reasoning), ``tool_call_parser`` →
``--tool-call-parser X --enable-auto-tool-choice``, and the gateway's media policy →
``--allowed-media-domains`` plus ``VLLM_MEDIA_URL_ALLOW_REDIRECTS=0`` (``model_flags``,
``model_env``)::

    reasoning: qwen3, remote_media: allowlist [img.example.com]
      → … --reasoning-parser qwen3 --allowed-media-domains img.example.com --host …
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gpupool.config.models import (
    LaunchConfig,
    ModelConfig,
    ReasoningParser,
    RemoteMediaPolicy,
    WorkerConfig,
)
from gpupool.config.swap import sleeps
from gpupool.workers.kvevents.source import KvSource
from gpupool.workers.registry import MediaCaps
from gpupool.workers.supervisor.errors import LaunchConfigError

WORKER_HOST = "127.0.0.1"
_RESERVED = {
    "host": "gpupool binds workers to 127.0.0.1 itself",
    "port": "use `launch.port` (or omit it for a free port)",
    "served-model-name": "the worker's `model` is passed as --served-model-name",
    "uds": "gpupool talks to workers over TCP",
}
_UNSAFE_PATH_CHARS = re.compile(r"[^A-Za-z0-9_.-]")
# A domain that never resolves (RFC 6761): vLLM treats an empty allowlist as "any domain".
NO_MEDIA_DOMAIN = "media.invalid"
NO_REDIRECTS_ENV = "VLLM_MEDIA_URL_ALLOW_REDIRECTS"


def flag_key(key: str) -> str:
    """``--max_model_len`` / ``max-model-len`` → ``max-model-len`` (vLLM accepts both spellings)."""
    return key.lstrip("-").replace("_", "-")


def arg_value(args: Mapping[str, Any], name: str) -> Any:
    """The value of flag ``name`` in ``args`` whatever its spelling, or None."""
    for key, value in args.items():
        if flag_key(key) == name:
            return value
    return None


def has_arg(args: Mapping[str, Any], name: str) -> bool:
    """Whether ``args`` names flag ``name`` at all (``false`` and ``null`` count: an opt-out)."""
    return any(flag_key(key) == name for key in args)


def check_launch(launch: LaunchConfig) -> list[str]:
    """Problems with a launch section, each naming its field path (empty when fine)."""
    problems = [
        f"launch.args.{key}: not allowed here; {_RESERVED[flag_key(key)]}"
        for key in launch.args
        if flag_key(key) in _RESERVED
    ]
    for i, token in enumerate(launch.command):
        name = flag_key(token.partition("=")[0]) if token.startswith("--") else ""
        if name in _RESERVED and not _is_port_placeholder(launch.command, i):
            problems.append(f"launch.command[{i}]: `{token}` is not allowed; {_RESERVED[name]}")
    mm = arg_value(launch.args, "limit-mm-per-prompt")
    if isinstance(mm, str) and not isinstance(_loads(mm), dict):
        problems.append("launch.args.limit-mm-per-prompt: must be a mapping or a JSON object")
    return problems


def _is_port_placeholder(command: list[str], i: int) -> bool:
    token = command[i]
    follower = command[i + 1] if i + 1 < len(command) else ""
    return token == "--port={port}" or (token == "--port" and follower == "{port}")


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _launch_of(worker: WorkerConfig) -> LaunchConfig:
    if worker.launch is None:
        raise LaunchConfigError([f"workers.{worker.name}: has no `launch` section"])
    return worker.launch


def _arg_tokens(key: str, value: Any) -> list[str]:
    flag = "--" + key.lstrip("-")
    if value is True:
        return [flag]
    if value is False or value is None:
        return []
    if isinstance(value, Mapping | list | tuple):
        return [flag, json.dumps(value)]
    return [flag, str(value)]


def build_command(worker: WorkerConfig, port: int, model: ModelConfig | None = None) -> list[str]:
    """The argv that starts ``worker`` listening on ``127.0.0.1:port``; ``model`` (the
    worker's model) adds the flags of :func:`model_flags`."""
    launch = _launch_of(worker)
    problems = check_launch(launch)
    if problems:
        raise LaunchConfigError([f"workers.{worker.name}.{p}" for p in problems])
    argv = [
        part.replace("{model_path}", launch.model_path)
        .replace("{port}", str(port))
        .replace("{python}", sys.executable)
        for part in launch.command
    ]
    for key, value in launch.args.items():
        argv += _arg_tokens(key, value)
    if model is not None:
        argv += model_flags(worker, model)
    if sleeps(worker) and not has_arg(launch.args, "enable-sleep-mode"):
        argv.append("--enable-sleep-mode")  # swap groups and idle sleep (gpupool/config/swap.py)
    return [*argv, "--host", WORKER_HOST, "--port", str(port), "--served-model-name", worker.model]


def cache_dir(state_dir: str | os.PathLike[str], gpu_cache_key: str | None) -> Path:
    """``<state_dir>/cache/<key>``: one compile/Triton cache per GPU architecture.

    Triton kernels and vLLM compile artifacts are reusable between cards of one architecture
    and compute capability (a cache warmed on a 96 GB card serves a 32 GB one), so the caller
    keys them by that, not by card.
    """
    key = _UNSAFE_PATH_CHARS.sub("_", gpu_cache_key or "cpu").strip(".") or "cpu"
    return Path(os.path.abspath(state_dir)) / "cache" / key


def build_env(
    worker: WorkerConfig,
    gpu_cache_key: str | None,
    state_dir: str | os.PathLike[str],
    base: Mapping[str, str] | None = None,
    model: ModelConfig | None = None,
) -> dict[str, str]:
    """Inherited environment (``base``, default ``os.environ``) + GPUs + caches + the
    model's :func:`model_env` + ``launch.env``.

    ``gpus`` are numbered as nvidia-smi and NVML number them (``CUDA_DEVICE_ORDER=PCI_BUS_ID``
    unless already set): CUDA's default order puts the fastest card first, which on a mixed
    PRO 6000 + 5090 host need not be the nvidia-smi order.

    ``TRITON_CACHE_DIR`` is set explicitly: vLLM only points Triton inside its own compile
    cache when the variable is unset, and autotuning results must survive restarts.
    """
    launch = _launch_of(worker)
    env = dict(os.environ if base is None else base)
    if launch.gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in launch.gpus)
        env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    cache = cache_dir(state_dir, gpu_cache_key)
    env["VLLM_CACHE_ROOT"] = str(cache / "vllm")
    env["TRITON_CACHE_DIR"] = str(cache / "triton")
    if model is not None:
        env.update(model_env(model))
    if sleeps(worker):
        env["VLLM_SERVER_DEV_MODE"] = "1"  # serves /sleep and /wake_up (never proxied)
    env.update(launch.env)
    return env


def _positive_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    return value if isinstance(value, int) and value > 0 else None


def capacity_of(worker: WorkerConfig) -> int | None:
    """Gateway-side concurrency: ``max_inflight``, else ``--max-num-seqs``, else None."""
    if worker.max_inflight is not None:
        return worker.max_inflight
    if worker.launch is None:
        return None
    return _positive_int(arg_value(worker.launch.args, "max-num-seqs"))


def _count(limit: Any) -> int | None:
    if isinstance(limit, Mapping):
        limit = limit.get("count")
    if isinstance(limit, bool) or not isinstance(limit, int):
        return None
    return max(limit, 0)


def media_limits_of(worker: WorkerConfig) -> MediaCaps:
    """Media items per prompt from ``--limit-mm-per-prompt`` (legacy or configurable form).

    An unspecified modality is unlimited (vLLM's default is 999); ``--language-model-only``
    admits no media at all.
    """
    if worker.launch is None:
        return MediaCaps()
    args = worker.launch.args
    if arg_value(args, "language-model-only") is True:
        return MediaCaps(image=0, video=0, audio=0)
    raw = arg_value(args, "limit-mm-per-prompt")
    if isinstance(raw, str):
        raw = _loads(raw)
    if not isinstance(raw, Mapping):
        return MediaCaps()
    return MediaCaps(
        image=_count(raw.get("image")),
        video=_count(raw.get("video")),
        audio=_count(raw.get("audio")),
    )


# ---- flags implied by the worker's model ----------------------------------------------------


def worker_reasoning_parser(worker: WorkerConfig, model: ModelConfig) -> str | None:
    """The reasoning parser vLLM itself runs for ``worker``, or None (the gateway splits).

    A launched worker runs the model's ``reasoning`` parser unless ``launch.args`` set
    ``reasoning-parser`` (a name, or ``false`` to let the gateway split). A ``url:`` worker
    is assumed to run without one.
    """
    if worker.launch is None:
        return None
    args = worker.launch.args
    if has_arg(args, "reasoning-parser"):
        value = arg_value(args, "reasoning-parser")
        return value if isinstance(value, str) and value else None
    return None if model.reasoning is ReasoningParser.none else model.reasoning.value


def model_flags(worker: WorkerConfig, model: ModelConfig) -> list[str]:
    """vLLM flags the model implies for a launched worker, leaving out any ``args`` names."""
    launch = _launch_of(worker)
    wanted: list[tuple[str, list[str]]] = []
    if model.reasoning is not ReasoningParser.none:
        wanted.append(("reasoning-parser", [model.reasoning.value]))
    if model.tool_call_parser:
        wanted.append(("tool-call-parser", [model.tool_call_parser]))
        wanted.append(("enable-auto-tool-choice", []))
    domains = media_domains(model)
    if domains is not None:
        wanted.append(("allowed-media-domains", domains))
    out: list[str] = []
    for name, values in wanted:
        if not has_arg(launch.args, name):
            out += [f"--{name}", *values]
    return out


def media_domains(model: ModelConfig) -> list[str] | None:
    """vLLM's ``--allowed-media-domains`` for the model's ``remote_media`` policy (None: any)."""
    if model.remote_media is RemoteMediaPolicy.allow:
        return None
    if model.remote_media is RemoteMediaPolicy.allowlist and model.remote_media_domains:
        return list(model.remote_media_domains)
    return [NO_MEDIA_DOMAIN]


def model_env(model: ModelConfig) -> dict[str, str]:
    """Environment the model implies: media fetches never follow redirects (whatever
    ``remote_media`` says), so an allowed host cannot bounce the worker to a private address
    the gateway would have refused. ``launch.env`` may set the variable back."""
    return {} if model.remote_media is RemoteMediaPolicy.deny else {NO_REDIRECTS_ENV: "0"}


# ---- KV-cache events (precise prefix routing) ----------------------------------------------

_IPC_MAX = 100  # a Unix socket path's limit is 107 bytes


def kv_socket_dir(state_dir: str | os.PathLike[str]) -> Path:
    """Where launched workers' event sockets live: ``<state_dir>/kv``, or a short directory
    under the temp dir named after it when that path is too long for a Unix socket."""
    path = Path(os.path.abspath(state_dir)) / "kv"
    if len(str(path)) + 40 <= _IPC_MAX:
        return path
    digest = hashlib.sha256(str(path).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"gpupool-kv-{digest}"


def kv_events(
    worker: WorkerConfig, argv: list[str], env: dict[str, str], seed: str, sock_dir: Path
) -> tuple[list[str], dict[str, str], KvSource | None]:
    """``argv`` and ``env`` publishing vLLM's KV-cache events on Unix sockets in ``sock_dir``
    (vLLM binds ``ipc://`` endpoints; a TCP one would listen on every interface, and the events
    carry prompts' tokens), with ``PYTHONHASHSEED`` fixed (``seed``, unless ``launch.env`` or
    the gateway's environment set one), and where the gateway subscribes. A command that sets
    ``--kv-events-config`` itself keeps it; the gateway then does not subscribe."""
    if any(flag_key(a.partition("=")[0]) == "kv-events-config" for a in argv if a.startswith("--")):
        return argv, env, None
    # the name cut short, and a digest of it whole: two workers whose names share their
    # first characters never share a socket (one's index would take the other's blocks)
    digest = hashlib.sha256(worker.name.encode()).hexdigest()[:8]
    name = _UNSAFE_PATH_CHARS.sub("_", worker.name)[:20] + "-" + digest
    pub, replay = f"ipc://{sock_dir}/{name}.pub", f"ipc://{sock_dir}/{name}.replay"
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub,
              "replay_endpoint": replay}  # fmt: skip
    env = {**env, "PYTHONHASHSEED": env.get("PYTHONHASHSEED", seed)}
    source = KvSource(pub, replay, "", env["PYTHONHASHSEED"])
    return [*argv, "--kv-events-config", json.dumps(config)], env, source
