"""vLLM's sleep mode in the simulator (``gpupool sim --enable-sleep-mode``).

Serves vLLM's dev-mode routes: ``POST /sleep?level=1|2&mode=...``, ``POST /wake_up[?tags=...]``,
``GET /is_sleeping``, ``POST /collective_rpc`` (``reload_weights``), with the time each takes
(``--sleep-s``, ``--wake-s``, ``--reload-s``) and the host RAM a level-1 sleep would hold
(``--weights-gib``), shown by ``GET /sim/sleep``. ``POST /sim/sleep`` sets ``wake_fail``:
``"error"`` (the next wake answers 500), ``"crash"`` (the process exits) or ``"kv_cache"`` (every
wake of the ``kv_cache`` tag answers 500 after waking the other tags, until the knob is changed:
a level-2 wake that fails half-way, weights on the GPU while ``/is_sleeping`` says true, as in
vLLM while any tag sleeps), and ``sleep_fail``:
``"error"`` (the next sleep answers 500; the worker stays awake), ``"hang"`` (every sleep waits,
awake, until the knob is changed, then sleeps as asked: a sleep held up past its caller's timeout)
or ``"keep_memory"`` (every sleep answers 200 and says it sleeps, but its GPU memory stays held, as
vllm#32714 and #47654 report), and ``reload_fail``: ``"garbage"`` (every ``reload_weights`` answers
200 but leaves wrong weights: from then on the process answers garbage, ``!`` tokens, as a level-2
wake without a correct reload does in vllm#29341, until it is restarted).

``mode`` is vLLM's: what a sleep does with the generations in flight (those waiting for a slot
included). ``wait`` lets them finish (one whose client left ends at once), then sleeps; such a
sleep is counted (``sleeps_waited``), not a violation: it loses nothing. ``abort`` (vLLM's
default, when ``mode`` is absent) aborts them (each client gets what vLLM's gets: the stream ends
with ``finish_reason: "abort"`` and ``[DONE]``, a whole reply is a 200 with what was made), then
sleeps; that loses work, so it is a violation. ``keep`` pauses them, as vLLM 0.26 does (its
scheduler paused, the running requests preempted, to be recomputed): they make no token from
the /sleep call until the wake that wakes every tag, then go on where they were; their streams
stay open. Such a sleep is counted (``sleeps_kept``), not a violation: it loses nothing. From
the /sleep call until the worker sleeps, a generation request is refused (and a violation) as
while asleep: vLLM would hold it until the wake.

A shared-GPU ledger (``--sleep-ledger FILE``, one JSON file for every simulated worker of one
GPU) holds each one's ``--gpu-memory-utilization`` share while it is awake. A start or a wake
that would take the GPU past all of it fails the way CUDA does (start-up: the process exits with
vLLM's free-memory error; a wake: 500 ``CUDA out of memory``) and is written to the ledger's
``violations``, as is any generation request (or stored response's route, ``stored.py``) that
reaches a worker while it sleeps, and any sleep that aborted a generation. Each member's entry
also has its ``sleeps_waited`` and ``sleeps_kept``, and ``held_bytes``, what NVML would say its
process holds on the GPU (its share of a ``GPU_BYTES`` card while it holds it, ``RESIDUE_BYTES``
asleep: ``sim/memory.py`` reads it as the gateway's NVML seam). Tests read the ledger to prove
that two workers of one GPU were never awake together, that none was sent a request while it
slept, and that no sleep cut a generation short.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import wraps
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import click
import orjson
from starlette.types import Receive, Scope, Send

_GENERATION = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})
_STORED = "/v1/responses/"  # a stored response's routes: served by the engine's process
_ROUTES = frozenset({"/sleep", "/wake_up", "/is_sleeping", "/collective_rpc", "/sim/sleep"})
_TAGS = frozenset({"weights", "kv_cache"})
_MODES = ("abort", "wait", "keep")  # vLLM's PauseMode; "abort" when the query has none
_CTX_KEY = "gpupool.sim.sleep"
GPU_BYTES = 80 << 30  # the simulated card (its ledger's shares are of it)
RESIDUE_BYTES = 400 << 20  # what a sleeping vLLM process keeps (CUDA context)
_SLEEP_FAILS = (None, "error", "hang", "keep_memory")


@dataclass(slots=True)
class SleepSettings:
    enabled: bool = True
    share: float = 0.9  # --gpu-memory-utilization
    ledger: str | None = None
    member: str = "sim"
    sleep_s: float = 0.05
    wake_s: float = 0.2
    reload_s: float = 0.5
    weights_gib: float = 16.0


@dataclass
class _Ledger:
    """The shared-GPU ledger: a JSON file, read and written under an exclusive lock."""

    path: Path

    @contextmanager
    def open(self) -> Iterator[dict[str, Any]]:
        lock = self.path.with_name(self.path.name + ".lock")
        with lock.open("a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                data: dict[str, Any] = {"members": {}, "violations": []}
                if self.path.exists() and self.path.stat().st_size:
                    data = orjson.loads(self.path.read_bytes())
                yield data
                tmp = self.path.with_name(self.path.name + ".tmp")
                tmp.write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2))
                tmp.replace(self.path)
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)


@dataclass
class SleepMode:
    settings: SleepSettings
    asleep: bool = False
    level: int = 0
    awake_tags: set[str] = field(default_factory=lambda: set(_TAGS))
    sleeps: int = 0
    sleeps_waited: int = 0  # sleeps (mode=wait) that waited for generations to end
    sleeps_kept: int = 0  # sleeps (mode=keep) that paused generations until the wake
    wakes: int = 0
    falling: bool = False  # a /sleep is under way: generation requests are refused
    violations: list[str] = field(default_factory=list)
    wake_fail: str | None = None
    sleep_fail: str | None = None
    reload_fail: str | None = None
    garbled: bool = False  # a reload_weights under reload_fail "garbage": answers are garbage
    running: Callable[[], int] = lambda: 0  # generations in flight (the app sets it)
    abort: Callable[[], None] = lambda: None  # the engine's abort of them all (the app sets it)
    freeze: Callable[[], None] = lambda: None  # the engine's pause of them all (the app sets it)
    thaw: Callable[[], None] = lambda: None  # and its resume
    # the engine's prefix cache emptied (the app sets it): vLLM's sleep at level 1 or 2 clears
    # it (``EngineCore.sleep``: ``pause_scheduler(clear_cache=True)``), its KV cache discarded
    clear_cache: Callable[[], None] = lambda: None
    _unhung: asyncio.Event = field(default_factory=asyncio.Event)  # set: sleeps go on
    _ended: asyncio.Event = field(default_factory=asyncio.Event)  # set: a generation ended
    _sleeping: asyncio.Lock = field(default_factory=asyncio.Lock)  # one sleep at a time

    def __post_init__(self) -> None:
        s = self.settings
        self._ledger = _Ledger(Path(s.ledger)) if s.ledger else None
        if not self._claim("start"):
            print(
                "ValueError: Free memory on device cuda:0 on startup is less than desired GPU "
                f"memory utilization ({s.share:g}): another process holds it (sim ledger).",
                file=sys.stderr,
                flush=True,
            )
            raise SystemExit(1)

    # -- the ledger -------------------------------------------------------------------------

    def _claim(self, what: str) -> bool:
        """Take this worker's share of the GPU; False (and a violation) when it does not fit."""
        if self._ledger is None:
            return True
        s = self.settings
        with self._ledger.open() as data:
            members = data.setdefault("members", {})
            holding = {k: m for k, m in members.items() if k != s.member and _holds(m)}
            others = sum(m["share"] for m in holding.values())
            if others + s.share > 1.0 + 1e-9:
                awake = sorted(holding)
                note = f"{s.member}: {what} while {', '.join(awake)} awake (CUDA out of memory)"
                data.setdefault("violations", []).append(note)
                self.violations.append(note)
                return False
            members[s.member] = {"share": s.share, "awake": True, "pid": os.getpid(),
                                 "held_bytes": int(s.share * GPU_BYTES),
                                 "sleeps_waited": self.sleeps_waited,
                                 "sleeps_kept": self.sleeps_kept}  # fmt: skip
            data.setdefault("peak_awake", 0.0)
            data["peak_awake"] = max(data["peak_awake"], others + s.share)
        return True

    def _release(self) -> None:
        if self._ledger is None:
            return
        with self._ledger.open() as data:
            member = data.setdefault("members", {}).get(self.settings.member)
            if member is not None:
                if self.sleep_fail != "keep_memory":  # (else it stays held: awake, to CUDA)
                    member["awake"], member["held_bytes"] = False, RESIDUE_BYTES
                member["sleeps_waited"] = self.sleeps_waited
                member["sleeps_kept"] = self.sleeps_kept

    def _violation(self, note: str) -> None:
        self.violations.append(note)
        if self._ledger is not None:
            with self._ledger.open() as data:
                data.setdefault("violations", []).append(f"{self.settings.member}: {note}")

    # -- HTTP -------------------------------------------------------------------------------

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> bool:
        """Serve a sleep route, or refuse generation while asleep; False: not ours."""
        path = scope["path"]
        if (path in _GENERATION or path.startswith(_STORED)) and (self.asleep or self.falling):
            await _drain(receive)
            self._violation(f"{path} while {'asleep' if self.asleep else 'falling asleep'}")
            refusal = {"error": {"message": "The model is sleeping.", "code": 503}}
            await _reply(send, 503, refusal)
            return True
        if path not in _ROUTES:
            return False
        body = await _drain(receive)
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        status, payload = await self._route(scope["method"], path, query, body)
        await _reply(send, status, payload)
        return True

    async def _route(
        self, method: str, path: str, query: dict[str, list[str]], body: bytes
    ) -> tuple[int, Any]:
        if not self.settings.enabled and path != "/sim/sleep":
            return 500, {"error": {"message": "Sleep mode is not enabled (--enable-sleep-mode)."}}
        handlers: dict[tuple[str, str], Callable[[], Any]] = {
            ("POST", "/sleep"): lambda: self._sleep_route(query),
            ("POST", "/wake_up"): lambda: self.wake(set(query.get("tags") or _TAGS)),
            ("GET", "/is_sleeping"): lambda: self.is_sleeping(),
            ("POST", "/collective_rpc"): lambda: self.rpc(body),
            ("GET", "/sim/sleep"): lambda: self.stats(),
            ("POST", "/sim/sleep"): lambda: self.control(body),
        }
        handler = handlers.get((method, path))
        if handler is None:
            return 405, {"detail": "Method Not Allowed"}
        result = handler()
        if asyncio.iscoroutine(result):
            result = await result
        assert isinstance(result, tuple)
        return result

    async def _sleep_route(self, query: dict[str, list[str]]) -> tuple[int, Any]:
        level, mode, errors = _sleep_query(query)
        if errors:
            return 422, {"detail": errors}
        return await self.sleep(level, mode)

    async def sleep(self, level: int, mode: str = "abort") -> tuple[int, Any]:
        if self.sleep_fail == "error":
            self.sleep_fail = None
            msg = "CUDA error: an illegal memory access (sim): the engine could not sleep."
            return 500, {"error": {"message": msg, "type": "InternalServerError", "code": 500}}
        while self.sleep_fail == "hang":  # (its caller may have given up: it goes on all the same)
            self._unhung.clear()
            await self._unhung.wait()
        async with self._sleeping:
            if not self.asleep:
                self.falling = True
                try:
                    await self._pause(mode)
                    await asyncio.sleep(self.settings.sleep_s)
                finally:
                    self.falling = False
                self.asleep, self.level, self.awake_tags = True, max(level, 1), set()
                self.clear_cache()
                self.sleeps += 1
                self._release()
        return 200, {"status": "sleeping", "level": level}

    async def _pause(self, mode: str) -> None:
        """vLLM's pause before a sleep: abort the generations in flight, wait for them, or
        keep them (frozen until the wake)."""
        running = self.running()
        if not running:
            return
        if mode == "keep":
            self.freeze()
            self.sleeps_kept += 1
            return
        if mode == "abort":
            self._violation(f"sleep (mode=abort) aborted {running} generation(s)")
            self.abort()
        else:
            self.sleeps_waited += 1
        while self.running():  # (an aborted one ends at its next position: at once)
            self._ended.clear()
            await self._ended.wait()

    def generation_ended(self) -> None:
        """The app's word that a generation ended (a waiting sleep counts them again)."""
        self._ended.set()

    async def wake(self, tags: set[str]) -> tuple[int, Any]:
        if not self.asleep:
            return 200, {"status": "awake", "tags": sorted(tags)}
        if self.wake_fail == "crash":
            print("RuntimeError: CUDA error: an illegal memory access", file=sys.stderr, flush=True)
            os._exit(1)
        if self.wake_fail == "error" or (not self.awake_tags and not self._claim("wake")):
            self.wake_fail = None if self.wake_fail == "error" else self.wake_fail
            msg = "CUDA out of memory. Tried to allocate the model's weights (sim)."
            return 500, {"error": {"message": msg, "type": "InternalServerError", "code": 500}}
        await asyncio.sleep(self.settings.wake_s)
        if self.wake_fail == "kv_cache" and "kv_cache" in tags:
            self.awake_tags |= tags & _TAGS - {"kv_cache"}
            msg = "CUDA out of memory. Tried to allocate the KV cache (sim)."
            return 500, {"error": {"message": msg, "type": "InternalServerError", "code": 500}}
        self.awake_tags |= tags & _TAGS
        if self.awake_tags == _TAGS:
            self.asleep, self.level = False, 0
            self.wakes += 1
            self.thaw()  # (vLLM resumes its scheduler once all memory is resident)
        return 200, {"status": "sleeping" if self.asleep else "awake", "tags": sorted(tags)}

    def is_sleeping(self) -> tuple[int, Any]:
        return 200, {"is_sleeping": self.asleep}

    async def rpc(self, body: bytes) -> tuple[int, Any]:
        try:
            method = orjson.loads(body).get("method")
        except (orjson.JSONDecodeError, AttributeError):
            return 400, {"detail": "Request body must be a JSON object"}
        if method == "reload_weights":
            await asyncio.sleep(self.settings.reload_s)
            self.garbled = self.garbled or self.reload_fail == "garbage"
        return 200, {"results": [None]}

    def stats(self) -> tuple[int, Any]:
        s = self.settings
        host = s.weights_gib if self.asleep and self.level == 1 else 0.0
        return 200, {"asleep": self.asleep, "level": self.level, "sleeps": self.sleeps,
                     "sleeps_waited": self.sleeps_waited, "sleeps_kept": self.sleeps_kept,
                     "falling_asleep": self.falling,
                     "wakes": self.wakes, "host_ram_gib": host, "share": s.share,
                     "garbled": self.garbled,
                     "violations": self.violations}  # fmt: skip

    def control(self, body: bytes) -> tuple[int, Any]:
        try:
            knobs = orjson.loads(body or b"{}")
        except orjson.JSONDecodeError:
            return 400, {"detail": "not JSON"}
        if not isinstance(knobs, dict):
            return 400, {"detail": "a JSON object"}
        wake, sleep = knobs.get("wake_fail"), knobs.get("sleep_fail")
        reload = knobs.get("reload_fail")
        if (
            wake not in (None, "error", "crash", "kv_cache")
            or sleep not in _SLEEP_FAILS
            or reload not in (None, "garbage")
        ):
            detail = ("wake_fail: error, crash, kv_cache or null; sleep_fail: error, hang, "
                      "keep_memory or null; reload_fail: garbage or null")  # fmt: skip
            return 400, {"detail": detail}
        self.wake_fail, self.sleep_fail, self.reload_fail = wake, sleep, reload
        self._unhung.set()
        return self.stats()


def _holds(member: dict[str, Any]) -> bool:
    """Whether a ledger member holds its share: awake, and its process alive (a process that
    died gave its GPU memory back)."""
    if not member.get("awake"):
        return False
    try:
        pid = int(member.get("pid", 0))
        if pid <= 0:
            return False
        os.kill(pid, 0)
    except (OSError, ValueError):
        return False
    return True


def _sleep_query(query: dict[str, list[str]]) -> tuple[int, str, list[dict[str, Any]]]:
    """``level`` and ``mode`` as vLLM's route reads them, and FastAPI's 422 details if bad."""
    raw, mode = (query.get("level") or ["1"])[0], (query.get("mode") or ["abort"])[0]
    errors: list[dict[str, Any]] = []
    level = _level(raw, errors)
    if mode not in _MODES:
        expected = "'abort', 'wait' or 'keep'"
        msg = f"Input should be {expected}"
        errors.append({"type": "literal_error", "loc": ["query", "mode"], "msg": msg,
                       "input": mode, "ctx": {"expected": expected}})  # fmt: skip
    return level, mode, errors


def _level(raw: str, errors: list[dict[str, Any]]) -> int:
    where = ["query", "level"]
    try:
        level = int(raw)
    except ValueError:
        msg = "Input should be a valid integer, unable to parse string as an integer"
        errors.append({"type": "int_parsing", "loc": where, "msg": msg, "input": raw})
        return 1
    if level < 0:
        errors.append({"type": "greater_than_equal", "loc": where, "input": raw, "ctx": {"ge": 0},
                       "msg": "Input should be greater than or equal to 0"})  # fmt: skip
    elif level > 2:
        errors.append({"type": "less_than_equal", "loc": where, "input": raw, "ctx": {"le": 2},
                       "msg": "Input should be less than or equal to 2"})  # fmt: skip
    return level


async def _drain(receive: Receive) -> bytes:
    parts = []
    while True:
        message = await receive()
        parts.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(parts)


async def _reply(send: Send, status: int, payload: Any) -> None:
    body = orjson.dumps(payload)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# -- the command line (``gpupool sim``): options of their own, kept out of SimConfig --------------


def sleep_options(command: Callable[..., None]) -> Callable[..., None]:
    """Add the sleep-mode options to ``gpupool sim``; they reach the app through the click
    context (:func:`settings_from_context`), not the command's own arguments."""

    @wraps(command)
    def run(*args: Any, **kwargs: Any) -> None:
        enabled = kwargs.pop("enable_sleep_mode")
        settings = SleepSettings(
            enabled=enabled or os.environ.get("VLLM_SERVER_DEV_MODE") == "1",
            share=kwargs.pop("gpu_memory_utilization"),
            ledger=kwargs.pop("sleep_ledger"),
            member=f"{kwargs.get('host', '127.0.0.1')}:{kwargs.get('port', 8000)}",
            sleep_s=kwargs.pop("sleep_s"),
            wake_s=kwargs.pop("wake_s"),
            reload_s=kwargs.pop("reload_s"),
            weights_gib=kwargs.pop("weights_gib"),
        )
        if enabled or settings.ledger:
            click.get_current_context().meta[_CTX_KEY] = settings
        command(*args, **kwargs)

    options = [
        click.option("--enable-sleep-mode", is_flag=True, help="Serve vLLM's sleep routes."),
        click.option("--gpu-memory-utilization", default=0.9, show_default=True, type=float,
                     help="The GPU share held while awake (the sleep ledger's)."),
        click.option("--sleep-ledger", default=None, help="Shared-GPU ledger file (JSON)."),
        click.option("--sleep-s", default=0.05, show_default=True, type=float),
        click.option("--wake-s", default=0.2, show_default=True, type=float),
        click.option("--reload-s", default=0.5, show_default=True, type=float,
                     help="Level 2: reload_weights' time."),
        click.option("--weights-gib", default=16.0, show_default=True, type=float,
                     help="Host RAM a level-1 sleep holds (shown by /sim/sleep)."),
    ]  # fmt: skip
    for option in reversed(options):
        run = option(run)
    return run


def settings_from_context() -> SleepSettings | None:
    ctx = click.get_current_context(silent=True)
    value = ctx.meta.get(_CTX_KEY) if ctx is not None else None
    return value if isinstance(value, SleepSettings) else None
