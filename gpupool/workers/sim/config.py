"""The simulator's one configuration object."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Literal

VLLM_VERSION = "0.32.0"

Mode = Literal["echo", "lorem", "script"]
Chunking = Literal["token", "chars"]
ReasoningParserName = Literal["qwen3"]

MODES: tuple[Mode, ...] = ("echo", "lorem", "script")
CHUNKINGS: tuple[Chunking, ...] = ("token", "chars")
REASONING_PARSERS: tuple[ReasoningParserName, ...] = ("qwen3",)


@dataclass(slots=True)
class GpuShape:
    """The GPU-shaped engine (``gpupool sim --gpu``): vLLM's continuous batching in simulated time.

    Every step runs all scheduled sequences at once and lasts ``step_ms`` plus ``seq_step_ms`` per
    sequence in it plus ``prefill_ms_per_1k`` per thousand prompt tokens it computes; a decoding
    sequence gains ``tokens_per_step`` tokens a step. At most ``max_num_seqs`` run, the rest wait
    inside the engine; a step computes at most ``max_num_batched_tokens`` tokens (one per decoding
    sequence, prompt chunks in the rest). ``num_gpu_blocks`` (of 16 tokens) bounds the KV cache
    (``None``: a full window for every sequence), and the prefix cache within it evicts LRU.
    """

    step_ms: float = 20.0
    seq_step_ms: float = 0.5
    tokens_per_step: int = 1
    prefill_ms_per_1k: float = 10.0
    max_num_batched_tokens: int = 2048
    num_gpu_blocks: int | None = None

    def check(self) -> None:
        _check(self.step_ms > 0, "step_ms must be > 0")
        _check(self.seq_step_ms >= 0 and self.prefill_ms_per_1k >= 0,
               "seq_step_ms and prefill_ms_per_1k must be >= 0")  # fmt: skip
        _check(self.tokens_per_step >= 1, "tokens_per_step must be at least 1")
        _check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be at least 1")
        _check(self.num_gpu_blocks is None or self.num_gpu_blocks >= 1,
               "num_gpu_blocks must be at least 1")  # fmt: skip


@dataclass(slots=True)
class SimConfig:
    """How one simulated vLLM 0.32 worker looks and behaves.

    ``model`` is the first served name (used in responses and the metrics ``model_name`` label);
    ``served_model_names`` are further aliases. ``root`` is the model path on the card.
    The fault knobs (``fail_rate``, ``hang``, ``health_fail``, ``crash_after_tokens``) and the
    timing (``ttft_ms``, ``itl_ms``) are only initial values: ``POST /sim/control`` changes them.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    model: str = "sim-model"
    served_model_names: list[str] = field(default_factory=list)
    root: str = ""
    max_model_len: int = 4096
    max_num_seqs: int = 8
    ttft_ms: float = 0.0
    itl_ms: float = 0.0
    mode: Mode = "lorem"
    script: str | None = None
    script_chunking: Chunking = "token"
    output_tokens: int = 16
    reasoning_parser: ReasoningParserName | None = None
    startup_delay_s: float = 0.0
    crash_after_tokens: int | None = None
    fail_rate: float = 0.0
    hang: bool = False
    health_fail: bool = False
    seed: int = 0
    gpu: GpuShape | None = None  # None: the classic timing (``ttft_ms``/``itl_ms`` per request)
    # vLLM's --kv-events-config JSON and a model directory (``kvevents.py``): publish KV events
    kv_events_config: str | None = None
    tokenizer: str | None = None

    def __post_init__(self) -> None:
        if not self.root:
            self.root = "/models/" + self.model
        _check(self.mode in MODES, f"mode must be one of {', '.join(MODES)}")
        _check(self.script_chunking in CHUNKINGS, "script_chunking must be 'token' or 'chars'")
        _check(self.mode != "script" or self.script is not None, "mode 'script' needs a script")
        _check(
            self.reasoning_parser is None or self.reasoning_parser in REASONING_PARSERS,
            f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}",
        )
        _check(self.max_model_len >= 1, "max_model_len must be at least 1")
        _check(self.max_num_seqs >= 1, "max_num_seqs must be at least 1")
        _check(self.output_tokens >= 1, "output_tokens must be at least 1")
        _check(0.0 <= self.fail_rate <= 1.0, "fail_rate must be between 0 and 1")
        _check(self.ttft_ms >= 0 and self.itl_ms >= 0, "ttft_ms and itl_ms must be >= 0")
        if self.gpu is not None:
            self.gpu.check()

    @property
    def served_names(self) -> list[str]:
        """All names the worker answers to, the first one being the canonical one."""
        names = [self.model]
        names.extend(n for n in self.served_model_names if n not in names)
        return names

    @property
    def system_fingerprint(self) -> str:
        """``vllm-<version>-<hash8>``, fixed for one configuration as vLLM's (which hashes its
        engine configuration: model, context length, scheduler and parser settings)."""
        key = repr((self.root, self.max_model_len, self.max_num_seqs, self.reasoning_parser))
        return f"vllm-{VLLM_VERSION}-{hashlib.sha256(key.encode()).hexdigest()[:8]}"


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
