"""The one typed configuration tree, loaded from ``gpupool.yaml``.

Every field has a default and a description; named choices are enums; unknown keys are errors
(a typo must not be silently ignored). Each subsystem receives only its own part.
"""

from __future__ import annotations

import ipaddress
from enum import IntEnum, StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)


class LogFormat(StrEnum):
    text = "text"
    json = "json"


class ServerConfig(_Strict):
    host: str = Field("127.0.0.1", description="Address the gateway binds.")
    port: int = Field(8000, ge=0, le=65535, description="Port the gateway binds (0: any free).")
    expose_worker_header: bool = Field(
        False, description="Add `x-gpupool-worker: <name>` to every proxied response."
    )
    log_format: LogFormat = Field(LogFormat.text, description="`text` or `json` log lines.")
    log_prompts: bool = Field(False, description="Log request bodies (prompts). Off by default.")
    access_log: bool = Field(
        False,
        description="uvicorn access log (costs latency); with it, X-Forwarded-For from "
        "127.0.0.1 gives the logged client address.",
    )
    max_body_bytes: int = Field(
        32 * 1024 * 1024, gt=0, description="Largest request body accepted; beyond it: 413."
    )
    max_json_depth: int = Field(64, gt=0, description="Deepest JSON nesting accepted; 400 beyond.")
    max_n: int = Field(16, gt=0, description="Most choices (`n`) one request may ask for.")
    max_sequences: int = Field(
        256,
        gt=0,
        description="Most sequences one request may generate or run: `n` x prompts for "
        "completions; inputs for embeddings, classify and pooling; (query, document) pairs for "
        "score and rerank; beyond it: 400.",
    )
    max_json_containers: int = Field(
        200_000,
        gt=0,
        description="Most JSON arrays and objects in a body (counted as `[` and `{` bytes); "
        "bounds the gateway's parsing time (a few ms at the limit); beyond it: 400.",
    )
    max_header_bytes: int = Field(
        64 * 1024, gt=0, description="Largest request line plus headers; beyond it: 431."
    )
    header_timeout_s: float = Field(
        10.0, gt=0, description="Time a client has to send the request line and headers."
    )
    body_timeout_s: float = Field(
        60.0, gt=0, description="Time a client has to send the whole request body (408 after)."
    )
    write_timeout_s: float = Field(
        60.0,
        gt=0,
        description="Window in which a client must take at least `write_min_bytes` of its "
        "reply while the gateway waits to write more (its socket's buffers full); one that "
        "takes less (stopped reading, or trickles) is cut: the connection is reset, the worker "
        "request closed (vLLM aborts it) and its slots given back (nginx's `send_timeout`).",
    )
    write_min_bytes: int = Field(
        16 * 1024,
        ge=1,
        description="Fewest bytes of its reply a client must take per `write_timeout_s` while "
        "the gateway's writes wait for it (a minimum rate, as Apache's `MinRate`): 16 KiB a "
        "minute is ~270 B/s, far below any real reader on a slow link, far above a client "
        "that takes one TCP segment now and then to hold a worker slot. 1: any byte is "
        "progress.",
    )
    upstream_connect_timeout_s: float = Field(
        5.0, gt=0, description="Time to open a connection to a worker."
    )
    upstream_read_timeout_s: float = Field(
        600.0,
        gt=0,
        description="Idle deadline of a stream: the longest a worker may take to send a "
        "streamed answer's head, then each next line of it (502, or the stream's error event).",
    )
    upstream_total_timeout_s: float = Field(
        3600.0,
        gt=0,
        description="Total deadline of a whole (non-streamed) answer, head and body, from the "
        "moment the request is sent; a trickle of bytes does not extend it (502 after).",
    )
    upstream_max_head_bytes: int = Field(
        64 * 1024,
        gt=0,
        description="Largest response head (status line and headers, interim 1xx heads "
        "included) a worker may send; beyond it: 502.",
    )
    upstream_max_headers: int = Field(
        100, gt=0, description="Most response headers a worker may send (1xx included); 502."
    )
    upstream_max_interim: int = Field(
        8, ge=0, description="Most interim (1xx) responses before a worker's answer; 502."
    )
    upstream_max_body_bytes: int | None = Field(
        None,
        gt=0,
        description="Largest worker answer the gateway buffers whole (non-streamed); beyond "
        "it: 502. None: 4 x `max_body_bytes`.",
    )
    upstream_max_event_bytes: int | None = Field(
        None,
        gt=0,
        description="Largest SSE event (or line) the gateway buffers to reshape or read a "
        "stream; beyond it: the stream's error event. None: `max_body_bytes`.",
    )
    state_dir: str = Field(
        ".gpupool", description="Directory for worker logs, caches, pid files and SD files."
    )
    ssl_certfile: str | None = Field(None, description="Serve HTTPS with this certificate (PEM).")
    ssl_keyfile: str | None = Field(None, description="The certificate's private key (PEM).")
    shutdown_grace_s: float = Field(
        30.0, ge=0, description="On SIGTERM, how long in-flight requests may take to finish."
    )


class ReasoningParser(StrEnum):
    none = "none"
    qwen3 = "qwen3"
    deepseek_r1 = "deepseek_r1"


class ReasoningField(StrEnum):
    reasoning = "reasoning"
    reasoning_content = "reasoning_content"
    both = "both"


class RemoteMediaPolicy(StrEnum):
    deny = "deny"
    allow = "allow"
    allowlist = "allowlist"


class MediaLimits(_Strict):
    image: int | None = Field(None, ge=0, description="Images per prompt (None: unlimited).")
    video: int | None = Field(None, ge=0, description="Videos per prompt (None: unlimited).")
    audio: int | None = Field(None, ge=0, description="Audio clips per prompt (None: unlimited).")


class ModelConfig(_Strict):
    name: str = Field(..., min_length=1, description="Name clients use; served-model-name.")
    aliases: list[str] = Field(default_factory=list, description="Other names for this model.")
    reasoning: ReasoningParser = Field(
        ReasoningParser.none,
        description="vLLM reasoning parser. Launched workers get `--reasoning-parser <name>` "
        "(vLLM splits, and applies structured outputs after the reasoning); set "
        "`launch.args.reasoning-parser: false` to opt out. For workers that return raw "
        "`<think>` text (`url:` workers, opted-out ones) the gateway splits with the same rules.",
    )
    tool_call_parser: str | None = Field(
        None,
        description="vLLM `--tool-call-parser` for launched workers (e.g. `hermes` for Qwen3, "
        "`qwen3_xml` for Qwen3.5), with `--enable-auto-tool-choice`; `launch.args` naming "
        "either flag win. None: no tool parsing.",
    )
    reasoning_field: ReasoningField = Field(
        ReasoningField.reasoning, description="Response field name(s) that carry the reasoning."
    )
    limits: MediaLimits | None = Field(
        None, description="Media items per prompt; launched workers default to limit-mm-per-prompt."
    )
    max_media_bytes: int = Field(
        20 * 1024 * 1024, gt=0, description="Largest decoded `data:` URI accepted."
    )
    remote_media: RemoteMediaPolicy = Field(
        RemoteMediaPolicy.allow,
        description="Whether http(s) media URLs may be forwarded. Launched workers enforce it "
        "too: `--allowed-media-domains` (deny: none; allowlist: the list) and "
        "VLLM_MEDIA_URL_ALLOW_REDIRECTS=0, unless `launch.args`/`launch.env` set them.",
    )
    remote_media_domains: list[str] = Field(
        default_factory=list, description="Domains allowed when remote_media is `allowlist`."
    )


class LaunchConfig(_Strict):
    gpus: list[int] | None = Field(None, description="CUDA_VISIBLE_DEVICES; omit on CPU hosts.")
    port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description=(
            "Port; if omitted, a free one in 10000-19999 (outside the kernel's range for outgoing "
            "connections, which could take it before the worker binds)."
        ),
    )
    model_path: str = Field(..., min_length=1, description="Model directory or hub id.")
    command: list[str] = Field(
        default_factory=lambda: ["vllm", "serve", "{model_path}"],
        description="Command; `{model_path}` and `{port}` are filled in.",
    )
    args: dict[str, Any] = Field(
        default_factory=dict,
        description="Each becomes `--key value`; true is a bare flag; mappings become JSON.",
    )
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment.")
    startup_timeout_s: float = Field(900.0, gt=0, description="Longest wait for readiness.")
    start_after: list[str] = Field(
        default_factory=list,
        description="Workers that must be ready (warmed) before this one first launches: "
        "seed 000's fix, a big card warms the shared Triton cache before a small card uses it.",
    )
    stop_timeout_s: float = Field(30.0, gt=0, description="SIGTERM → SIGKILL grace.")
    max_restarts: int = Field(5, ge=0, description="Crashes within restart_window_s → failed.")
    restart_window_s: float = Field(600.0, gt=0, description="Window for counting crashes.")
    backoff_initial_s: float = Field(1.0, gt=0, description="First restart delay.")
    backoff_max_s: float = Field(60.0, gt=0, description="Largest restart delay.")


class WarmupItem(_Strict):
    prompt: str | None = Field(None, description="A text prompt.")
    images: list[list[int]] = Field(
        default_factory=list, description="Image sizes [[w, h], ...] in one request."
    )
    max_tokens: int = Field(16, gt=0, description="Tokens to generate.")


class SleepLevel(IntEnum):
    weights_to_host = 1
    discard_weights = 2


class SleepConfig(_Strict):
    level: SleepLevel = Field(
        SleepLevel.weights_to_host,
        description="vLLM sleep level. 1: the weights move to host RAM and the KV cache is "
        "dropped (a wake takes about a second; costs the weights' size in host RAM while "
        "asleep). 2: weights and KV cache are dropped (no host RAM; a wake reads the weights "
        "from disk again, seconds to minutes).",
    )
    idle_s: float | None = Field(
        None,
        gt=0,
        description="Put the worker to sleep after this many seconds without requests (None: "
        "only when another worker of its swap group is wanted).",
    )


class SwapPolicy(StrEnum):
    weighed = "weighed"
    turns = "turns"


class SwapConfig(_Strict):
    policy: SwapPolicy = Field(
        SwapPolicy.weighed,
        description="`weighed`: switch when the waiting demand (count, age, priority) outweighs "
        "what the switch costs the awake model (its running and queued requests, the measured "
        "switch time), or a request would wait past `max_wait_s`; what waits meanwhile is "
        "woken for together. `turns`: gpupool's first policy, a switch for any waiting "
        "request once `min_awake_s` has passed (kept for comparison).",
    )
    max_wait_s: float = Field(
        30.0,
        gt=0,
        description="`weighed`: no request waits longer than this for its model's turn (the "
        "switch starts once the oldest has waited this less the measured switch time), however "
        "busy the awake model. Keep it under `queue.max_wait_s`, or the queue answers 429 "
        "first.",
    )
    max_switch_share: float = Field(
        0.1,
        gt=0,
        le=1,
        description="`weighed`: a switch must buy back 1/this times the waiting it costs the "
        "awake model's requests (each loses a round trip): with 0.1, a busy model spends about "
        "a tenth of its time at most on switches for a trickle of requests for another.",
    )
    min_awake_s: float = Field(
        10.0,
        ge=0,
        description="A woken worker with requests stays awake at least this long before another "
        "of its swap group may take the GPU (a model mid-job is not swapped out), unless a "
        "request would wait past `max_wait_s`; an idle one gives way at once.",
    )
    priority_weight_s: float = Field(
        10.0,
        ge=0,
        description="Fairness between a group's models: a model's turn comes by its oldest "
        "waiting request's age, less this many seconds per priority point (lower priority "
        "values first, as vLLM's).",
    )
    sleep_timeout_s: float = Field(
        120.0, gt=0, description="Longest wait for a worker's `/sleep` to answer."
    )
    wake_timeout_s: float = Field(
        300.0,
        gt=0,
        description="Longest wait for a wake (level 2 reads the weights from disk again); "
        "beyond it the worker is marked failed and restarted.",
    )
    pause_after_s: float | None = Field(
        60.0,
        ge=0,
        description="Once a switch away from the awake model has waited this long for its "
        "running requests, they are paused instead: vLLM's `/sleep?mode=keep` keeps them (their "
        "KV cache is dropped, their streams stay open and stall), the other model is served, "
        "and the next wake resumes them where they were, losing nothing a client holds (a "
        "paused request costs its prompt's prefill again). A minute lets a chat answer finish "
        "(no stall at all) yet keeps one long generation from holding the other model's users "
        "for many minutes. None: never pause, wait for them however long they take.",
    )
    sleep_residue_gib: float = Field(
        3.0,
        ge=0,
        description="What a launched worker may still hold on its GPUs once asleep (its CUDA "
        "context and CUDA-graph pool; vLLM's own sleep test allows 2 GiB for a 0.5B model). "
        "After a `/sleep` its memory (NVML, per process) is read until it holds no more; one "
        "that still holds more after `free_timeout_s` is restarted, never woken beside.",
    )
    free_timeout_s: float = Field(
        10.0, gt=0, description="Longest wait after a `/sleep` for the memory to be seen freed."
    )
    canary: bool = Field(
        True,
        description="After a level-2 wake (weights reloaded from disk), ask one fixed greedy "
        "prompt and compare with the answer recorded before its first level-2 sleep; another "
        "answer restarts the worker (a `url:` one is put back to sleep) before it takes "
        "requests.",
    )


class DiscoverRecord(StrEnum):
    a = "a"
    srv = "srv"


class DiscoverConfig(_Strict):
    dns: str = Field(
        ...,
        min_length=1,
        description="Name to resolve: a Compose service, a Kubernetes headless Service "
        "(`vllm-rtx5090.gpupool.svc.cluster.local`), or an SRV name.",
    )
    port: int | None = Field(
        None, ge=1, le=65535, description="Workers' port for A/AAAA records (SRV carries its own)."
    )
    record: DiscoverRecord = Field(
        DiscoverRecord.a, description="`a`: A and AAAA records with `port`; `srv`: SRV records."
    )
    every_s: float = Field(5.0, gt=0, description="Resolve again after this many seconds.")
    nameservers: list[str] = Field(
        default_factory=list,
        description="DNS servers as `ip` or `ip:port` (empty: the system's, /etc/resolv.conf).",
    )
    timeout_s: float = Field(
        2.0, gt=0, description="A lookup slower than this fails; the last good set is kept."
    )
    drain_s: float = Field(
        120.0,
        ge=0,
        description="A worker gone from DNS takes no new requests and is removed once its "
        "running ones finish, or after this long.",
    )
    scheme: str = Field("http", pattern=r"^https?$", description="`http` or `https`.")
    max_workers: int = Field(
        256,
        ge=1,
        description="Most workers this entry keeps. An answer with more addresses keeps the "
        "workers already in the pool, then the lowest addresses; the rest are left out, "
        "logged when their number changes and counted in `gpupool_discovery_dropped`. The "
        "gateway also keeps descriptors for itself: under a low `ulimit -n` fewer workers are "
        "taken (docs/security.md).",
    )

    @model_validator(mode="after")
    def _port_for_a(self) -> DiscoverConfig:
        if self.record is DiscoverRecord.a and self.port is None:
            raise ValueError("`port` is required with A/AAAA records (record: a)")
        return self


class WorkerKvEvents(_Strict):
    """Where a `url:` worker publishes its KV-cache events (it was started with
    `--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint":
    "tcp://*:PORT", "replay_endpoint": "tcp://*:PORT2"}'`)."""

    endpoint: str = Field(
        ...,
        pattern=r"^(tcp|ipc)://",
        description="Its PUB socket: tcp://host:port (or ipc://). `{host}` is the host of the "
        "worker's URL: for workers found by DNS, which all publish on the same port.",
    )
    replay_endpoint: str | None = Field(
        None, pattern=r"^(tcp|ipc)://", description="Its replay socket (gaps are filled from it)."
    )
    topic: str = Field("", description="The topic it publishes under.")
    hash_seed: str | None = Field(
        None,
        description="The worker's PYTHONHASHSEED; omit when unset (vLLM's fixed seed for sha256).",
    )
    tokenizer: str | None = Field(
        None,
        description="The model directory (tokenizer.json, chat template) vLLM reads; without "
        "one (and no launched worker of the model) routing stays approximate.",
    )


class WorkerConfig(_Strict):
    name: str = Field(..., min_length=1, pattern=r"^[A-Za-z0-9_.-]+$", description="Worker name.")
    model: str = Field(..., min_length=1, description="A model name from `models`.")
    url: str | None = Field(None, description="An existing vLLM server (unsupervised).")
    launch: LaunchConfig | None = Field(None, description="A vLLM process gpupool supervises.")
    discover: DiscoverConfig | None = Field(
        None,
        description="Workers found by DNS: each address becomes a `url:` worker named "
        "`<name>@<host>:<port>` with this entry's settings; it joins once its probe passes and "
        "is drained when it leaves DNS.",
    )
    max_inflight: int | None = Field(
        None, gt=0, description="Gateway-side concurrency cap (default: max-num-seqs, else 64)."
    )
    max_model_len: int | None = Field(
        None, gt=0, description="Override the window read from the worker's /v1/models."
    )
    warmup: list[WarmupItem] = Field(
        default_factory=list, description="Requests sent after readiness, before traffic."
    )
    sleep: SleepConfig | None = Field(
        None,
        description="vLLM sleep mode: launched workers get `--enable-sleep-mode` and "
        "`VLLM_SERVER_DEV_MODE=1`; `url:` workers must have been started so. Implied (level 1) "
        "for a worker in a `swap_group`.",
    )
    kv_events: WorkerKvEvents | None = Field(
        None, description="A `url:` worker's KV-cache events (precise prefix routing)."
    )
    swap_group: str | None = Field(
        None,
        min_length=1,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="Workers of one swap group share a GPU by taking turns: never two awake at "
        "once. Launched workers sharing a GPU whose gpu-memory-utilization adds up to more "
        "than 1 are grouped automatically (`gpupool check` says so).",
    )

    @field_validator("url")
    @classmethod
    def _url_scheme(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return v.rstrip("/") if v else v

    @model_validator(mode="after")
    def _one_source(self) -> WorkerConfig:
        if sum(x is not None for x in (self.url, self.launch, self.discover)) != 1:
            raise ValueError("give exactly one of `url`, `launch` or `discover`")
        if self.discover is not None and (self.swap_group is not None or self.sleep is not None):
            raise ValueError(
                "a `discover:` entry cannot use sleep mode (`swap_group`, `sleep`): its workers "
                "come and go at run time, outside the group's turns, so the group could wake a "
                "member beside one of them; list the group's workers with `url:`"
            )
        return self


class QueueBackend(StrEnum):
    memory = "memory"
    redis = "redis"


class RedisFailurePolicy(StrEnum):
    reject = "reject"
    local = "local"


class QueueConfig(_Strict):
    backend: QueueBackend = Field(QueueBackend.memory, description="`memory` or `redis`.")
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis for shared admission.")
    redis_prefix: str = Field("gpupool", description="Prefix of every Redis key.")
    max_queued: int = Field(1000, ge=0, description="Per model; beyond it: immediate 429.")
    max_queued_per_tenant: int | None = Field(
        None,
        ge=1,
        description="Most requests one tenant may have waiting in a model's queue (None: up to "
        "`max_queued`); beyond it that tenant gets an immediate 429 while others still queue.",
    )
    max_wait_s: float = Field(60.0, gt=0, description="Per model; x-gpupool-max-wait may lower.")
    reserved_slots: int = Field(
        1,
        ge=0,
        description="Slots of each worker that one tenant may not fill while another tenant is "
        "active (see `reserve_window_s`): kept free so that the others' next request starts at "
        "once instead of waiting behind a batch. A tenant alone uses every slot; a worker keeps "
        "at least one slot per tenant (capacity 1 reserves nothing). 0: off.",
    )
    reserve_window_s: float = Field(
        30.0,
        gt=0,
        description="A tenant counts as active for `reserved_slots` while it waits in a model's "
        "queue and for this long after it last asked for a slot of the model.",
    )
    shared_share: float = Field(
        0.5,
        gt=0,
        le=1,
        description="While another tenant has a request running on a worker, a tenant holding "
        "this share of the worker's slots (at least 1) takes no more there, so that its new "
        "requests' prefills do not slow every step of the other's (vLLM batches them with the "
        "running decodes). Held slots are never taken back. Part of `reserved_slots` (off with "
        "it); 1: off.",
    )
    keepalive_interval_s: float = Field(
        5.0, gt=0, description="SSE `: queued position=N` comment interval for queued streams."
    )
    lease_ttl_s: float = Field(10.0, gt=0, description="Redis slot lease TTL, renewed while held.")
    on_redis_down: RedisFailurePolicy = Field(
        RedisFailurePolicy.local,
        description="`local`: admit with this replica's share of capacity; `reject`: 503.",
    )
    replicas_hint: int = Field(
        1, ge=1, description="Replicas sharing Redis; sizes the local share when Redis is down."
    )


class KvEventsConfig(_Strict):
    """Precise prefix routing from vLLM's KV-cache events (docs/routing-kv-events.md)."""

    enabled: bool = Field(
        False,
        description="Launched vLLM workers publish their KV-cache events (`--kv-events-config` "
        "on free ports, a fixed PYTHONHASHSEED) and routing prefers the worker that holds the "
        "longest part of a request's prompt, as the events say. `url:` workers need their own "
        "`kv_events` entry.",
    )
    hash_seed: str = Field(
        "0",
        min_length=1,
        description="PYTHONHASHSEED given to launched workers (unless `launch.env` sets one): "
        "the seed of vLLM's first block hash, which the gateway must know.",
    )
    max_blocks_per_worker: int = Field(
        1_000_000,
        gt=0,
        description="Most blocks indexed per worker (a block is ~100 bytes here); the worker's "
        "own block count when vLLM shows a smaller one.",
    )
    pending_s: float = Field(
        30.0,
        gt=0,
        description="A request just placed counts as the blocks it will store for this long "
        "(until vLLM's events say they are stored).",
    )
    max_lead: float = Field(
        0.0,
        ge=0,
        le=1,
        description="The worker with the most of a prompt cached keeps it while at most this "
        "share of its capacity busier than the least busy candidate, or one request busier "
        "when it holds most of the prompt (0: only that, the throughput guard's rule).",
    )


class RoutingConfig(_Strict):
    retries: int = Field(2, ge=0, description="Other workers tried before the first byte.")
    migrations: int = Field(
        2,
        ge=0,
        description="Times one request may move to another worker of its model after its "
        "answer began, when its worker dies or an operator's drain or restart reaches its "
        "deadline: a stream continues where it stopped, a whole answer starts again "
        "(docs/migration.md). It queues for the new worker like any request; 0: off (the "
        "client gets the stream's error event or a 502, as before).",
    )
    prefix_affinity: bool = Field(True, description="Keep a conversation on one worker.")
    affinity_max_load: float = Field(
        1.0,
        ge=0,
        le=1,
        description="Affinity is ignored when its worker is this loaded (1: only when full; a "
        "conversation moved re-reads its whole history).",
    )
    affinity_max_lead: float = Field(
        0.0,
        ge=0,
        le=1,
        description="A conversation returns to its worker while that worker is at most this "
        "share of its capacity busier than the least busy candidate. 0 (the default): only "
        "while it is among the least busy, so no worker is filled past its neighbour; when "
        "every worker is full the conversation is still first in line for its own "
        "(`affinity_wait_s`). Higher keeps more conversations on their cache at the cost of "
        "uneven load (tokens/s on GPUs).",
    )
    affinity_wait_s: float = Field(
        2.0,
        ge=0,
        description="While every candidate is full, a queued conversation is first in line for "
        "its own worker's next slot for up to this long; a slot that frees elsewhere still goes "
        "to it when no other waiter takes it, so no slot stays empty (0: plain queue order).",
    )
    window_reserve_s: float = Field(
        60.0,
        ge=0,
        description="While a prompt that only larger windows hold came within this many seconds, "
        "a request that fits a smaller window goes to a smaller-window worker with a free slot "
        "before a larger-window one, however less busy (0: by load only).",
    )
    prefill_gate_tokens: int = Field(
        8192,
        ge=0,
        description="A streamed prompt of at least this many tokens waits for the long prefill "
        "before it on its worker to send its first event (vLLM fills each step's budget with "
        "both and the first one's first token comes later). Set it to the workers' "
        "--max-num-batched-tokens; 0: off.",
    )
    prefill_gate_max_wait_s: float = Field(
        30.0, gt=0, description="The longest a long prompt waits for the one before it."
    )
    exact_count_margin: float = Field(
        0.9,
        gt=0,
        le=1,
        description="A prompt whose estimate (bytes / 3) is below this fraction of the smallest "
        "window above it is routed without counting; above it the worker's /tokenize counts "
        "exactly. A worker's context-length 400 moves a misestimated prompt to a larger window.",
    )
    health_interval_s: float = Field(2.0, gt=0, description="Health-check period.")
    metrics_interval_s: float = Field(1.0, gt=0, description="Worker /metrics scrape period.")
    fail_threshold: int = Field(3, ge=1, description="Failed checks before a worker is out.")
    health_timeout_s: float = Field(
        10.0, gt=0, description="A health check slower than this fails (vLLM on busy CPUs is slow)."
    )
    default_capacity: int = Field(64, gt=0, description="Capacity when nothing else says.")
    probe_concurrency: int = Field(
        32,
        ge=1,
        description="Most health checks and load scrapes of `url:` and discovered workers in "
        "flight at once (each holds a connection); the others wait their turn, so a pool of "
        "thousands of addresses cannot take every descriptor of the gateway.",
    )
    kv_events: KvEventsConfig = Field(
        default_factory=KvEventsConfig, description="Precise prefix routing (KV-cache events)."
    )


class ApiKey(_Strict):
    name: str = Field("", description="Label for logs and metrics.")
    sha256: str = Field(..., min_length=64, max_length=64, description="Hex SHA-256 of the key.")
    tenant: str | None = Field(None, description="Fairness group; defaults to the name.")
    models: list[str] | None = Field(None, description="Allowed models (None: all).")
    priority_min: int = Field(
        0,
        description="Most urgent priority this key may ask for (lower is sooner, as vLLM's; "
        "requests default to 0). The default, 0, lets no key pass other tenants' requests of "
        "the default priority; give a key a negative `priority_min` to let it. A priority out "
        "of the key's range is clamped to it.",
    )
    priority_max: int = Field(1000, description="Least urgent priority this key may ask for.")
    rpm: int | None = Field(None, gt=0, description="Requests per minute.")
    tpm: int | None = Field(None, gt=0, description="Tokens per minute (prompt + completion).")
    max_concurrent: int | None = Field(None, gt=0, description="Concurrent requests.")

    @model_validator(mode="after")
    def _priority_range(self) -> ApiKey:
        if self.priority_min > self.priority_max:
            raise ValueError("priority_min must not be above priority_max")
        return self


class RevokedStreams(StrEnum):
    finish = "finish"
    cut = "cut"


class AuthConfig(_Strict):
    enabled: bool = Field(False, description="Require keys. Off only when explicitly false.")
    admin_key_sha256: str | None = Field(None, description="Hex SHA-256 of the admin key.")
    keys: list[ApiKey] = Field(default_factory=list, description="Client keys.")
    keys_file: str | None = Field(None, description="YAML file with more `keys`.")
    metrics_open: bool = Field(True, description="/metrics without a key.")
    tpm_reserve_tokens: int = Field(
        4096,
        ge=0,
        description="Completion tokens reserved against a key's `tpm` for a request without "
        "`max_tokens` (with it: `max_tokens`); settled to the real usage when the request ends.",
    )
    allow_unauthenticated_network: bool = Field(
        False,
        description="Let the gateway start with `enabled: false` while `server.host` is not a "
        "loopback address. Without keys, anyone who can reach the port can use every route, "
        "the admin API included (drain, restart, reload): say so here only on a network where "
        "every host is trusted (a container network published on 127.0.0.1, a private link). "
        "Without it such a config is refused by `serve`, `check` and a reload.",
    )
    allowed_hosts: list[str] = Field(
        default_factory=list,
        description="While `enabled` is false, the admin API and the pool page answer only "
        "requests whose `Host` is an IP address, `localhost` (or a `*.localhost` name) or one "
        "of these names, so that a web page whose own name was re-pointed at this gateway (DNS "
        "rebinding) cannot read or drive them. Add the names you open the page under "
        "(`gpupool.lan`); the client API is not affected.",
    )
    revoked_streams: RevokedStreams = Field(
        RevokedStreams.finish,
        description="What happens to the running streams of a key that a reload removes: "
        "`finish` (they run to their end) or `cut` (each ends at its next event with an error "
        "event). Its queued requests are always refused (401) and new ones get 401.",
    )


class CacheSharing(StrEnum):
    auto = "auto"
    tenant = "tenant"
    shared = "shared"


class TenancyConfig(_Strict):
    cache: CacheSharing = Field(
        CacheSharing.auto,
        description="Whose requests may reuse each other's prefix cache on a worker. `auto`: "
        "each tenant its own when auth is on and the keys name more than one tenant; `tenant`: "
        "always each tenant its own; `shared`: every tenant shares it (one organisation, on "
        "purpose). Isolated, the gateway sets vLLM's `cache_salt` from the tenant (a client's "
        "own salt is mixed into it) and prefix affinity is kept per tenant.",
    )
    salt_secret: str | None = Field(
        None,
        description="Secret keying the tenants' cache salts (HMAC-SHA256), so a worker's logs "
        "never show a tenant's name. Replicas in front of the same workers must share it. None: "
        "derived from `auth.admin_key_sha256`, else generated once and kept: in Redis with "
        "`queue.backend: redis` (every replica finds the same), else in "
        "`<server.state_dir>/cache-salt-secret` (mode 0600), so reloads, restarts and replicas "
        "keep each tenant's prefix cache warm.",
    )
    stored_response_ttl_s: float = Field(
        86400.0,
        gt=0,
        description="How long the gateway remembers which worker and tenant made a stored "
        "`/v1/responses` response (in Redis when `queue.backend` is redis, else in memory).",
    )
    max_stored_responses: int = Field(
        100_000,
        gt=0,
        description="Most stored responses remembered in memory (the oldest are forgotten first).",
    )


class GpuCard(_Strict):
    """The card behind one GPU index, for planning where NVML cannot say (``gpupool plan`` and
    ``check`` on a laptop). NVML's answer wins on a machine that has one."""

    name: str | None = Field(
        default=None,
        description="The card as NVML names it or a short form: `RTX PRO 6000`, `RTX 5090`, "
        "`H100`, `H200` (`gpupool plan --help` lists them).",
    )
    memory_gb: float | None = Field(
        default=None, gt=0, description="Its memory in GiB, as nvidia-smi's MiB / 1024."
    )

    @model_validator(mode="before")
    @classmethod
    def _short_form(cls, value: Any) -> Any:
        if isinstance(value, str):
            return {"name": value}
        if isinstance(value, int | float) and not isinstance(value, bool):
            return {"memory_gb": value}
        return value

    @model_validator(mode="after")
    def _known(self) -> GpuCard:
        if self.name is None and self.memory_gb is None:
            raise ValueError("give the card's `name` or its `memory_gb`")
        if self.name is not None and self.memory_gb is None:
            from gpupool.workers.planner.errors import PlanArgsError
            from gpupool.workers.planner.gpu_catalog import known_gpu_names, lookup_gpu

            try:
                lookup_gpu(self.name)
            except PlanArgsError:
                raise ValueError(
                    f"unknown card `{self.name}` (known: {known_gpu_names()}); "
                    "give `memory_gb` instead"
                ) from None
        return self


class GpupoolConfig(_Strict):
    server: ServerConfig = Field(
        default_factory=ServerConfig, description="The listening socket, its bounds and logs."
    )
    models: list[ModelConfig] = Field(..., min_length=1, description="Models served.")
    workers: list[WorkerConfig] = Field(..., min_length=1, description="Workers.")
    queue: QueueConfig = Field(
        default_factory=QueueConfig, description="Admission: the queue, its bounds and backend."
    )
    routing: RoutingConfig = Field(
        default_factory=RoutingConfig, description="Worker choice, health checks and scrapes."
    )
    auth: AuthConfig = Field(
        default_factory=AuthConfig, description="API keys, the admin key and per-key limits."
    )
    swap: SwapConfig = Field(
        default_factory=SwapConfig, description="How the workers of a swap group take turns."
    )
    tenancy: TenancyConfig = Field(
        default_factory=TenancyConfig, description="What tenants share: prefix caches."
    )
    gpus: dict[int, GpuCard] = Field(
        default_factory=dict,
        description="The card behind each GPU index (`0: RTX PRO 6000`, `1: {memory_gb: 31.8}`), "
        "for `gpupool plan` and `check` on machines without NVML.",
    )

    @model_validator(mode="after")
    def _cross_check(self) -> GpupoolConfig:
        names: set[str] = set()
        for i, m in enumerate(self.models):
            for n in (m.name, *m.aliases):
                if n in names:
                    raise ValueError(f"models[{i}]: name or alias `{n}` is used twice")
                names.add(n)
        model_names = {m.name for m in self.models}
        seen: set[str] = set()
        for i, w in enumerate(self.workers):
            if w.name in seen:
                raise ValueError(f"workers[{i}].name: `{w.name}` is used twice")
            seen.add(w.name)
            for dep in w.launch.start_after if w.launch else []:
                if dep not in {x.name for x in self.workers} or dep == w.name:
                    raise ValueError(f"workers[{i}].launch.start_after: no other worker `{dep}`")
            if w.model not in model_names:
                raise ValueError(
                    f"workers[{i}].model: `{w.model}` is not in `models` "
                    f"(known: {', '.join(sorted(model_names))})"
                )
        problem = unauthenticated_exposure(self)
        if problem is not None:
            raise ValueError(problem)
        from gpupool.config.swap import check_reloadable, form_swap_groups

        form_swap_groups(self.workers)
        check_reloadable(self.workers)
        return self

    def model(self, name: str) -> ModelConfig:
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(name)


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` serves this machine only (``localhost``, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def unauthenticated_exposure(cfg: GpupoolConfig) -> str | None:
    """Why ``cfg`` must not be served (auth off on a non-loopback address without the explicit
    ``auth.allow_unauthenticated_network``), or None."""
    auth = cfg.auth
    if auth.enabled or auth.allow_unauthenticated_network or is_loopback(cfg.server.host):
        return None
    return (
        f"auth.enabled: false on `server.host: {cfg.server.host}` (not a loopback address) lets "
        "anyone who can reach the port use every route, the admin API included; turn auth on "
        "(`gpupool new-key`), bind 127.0.0.1, or set `auth.allow_unauthenticated_network: true` "
        "if every host on that network is trusted"
    )
