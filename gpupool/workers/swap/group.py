"""One swap group: workers that take turns on one GPU, never two awake at once.

The group's *holder* is the one member that may use the GPU (awake, waking, starting, or
falling asleep); every other member is asleep, or waits at its launch gate (a launched worker
starting or restarting only launches while it holds the GPU). A switch, under the group's lock:

    holder ready ──▶ falling_asleep (no new requests; running ones finish, or are paused)
                 ──▶ POST /sleep?level=N&mode=wait|keep ──▶ asleep  (holder: none)
    target asleep ─▶ waking ──▶ POST /wake_up (level 2: + reload_weights) ──▶ ready
    target at its launch gate ──▶ launched, ready                  (holder: target)

The next member is woken only after the last one's /sleep answered (or its process was killed),
and admission grants slots only on ``ready`` workers, so no request reaches a sleeping worker.

Neither answer is trusted alone (``verify.py``):

    /sleep answered ──▶ its GPU memory read until freed ──▶ asleep
                    └─▶ still held after swap.free_timeout_s ──▶ failed, restarted (killed:
                        freed) ── never woken beside
    level-2 wake answered ──▶ canary = the answer recorded before its first level-2 sleep ─▶ ready
                          └─▶ another answer (or none) ──▶ launched: failed, restarted
                                                       └─▶ url: /sleep again, asleep

A failed sleep or wake marks the worker failed; a launched one is restarted as supervision
restarts a crash (its relaunch waits at the gate for its turn).

A switch waits ``swap.pause_after_s`` at most for the holder's running requests (an admin's
sleep, or an idle one, waits for them all); then it *pauses* them: ``/sleep?mode=keep`` keeps them
in vLLM, frozen (their KV cache dropped, recomputed at the wake), their streams open. They keep
their slots and in-flight counts on the sleeping worker (``Worker.paused_since``; the relay holds
their idle deadline meanwhile, ``Worker.held_since``), and count as demand for their model, waiting
since the pause with their best priority, so the policy gives it the GPU back in its turn; that
wake resumes them where they were.

A ``url:`` member frees the GPU only once gpupool knows it sleeps: its /sleep answered, or its
``/is_sleeping`` says so (``reading.py``). One that holds the GPU in a state that does not say
(failed: a /sleep or /wake_up failed or timed out, or its health checks did; drained; replaced by
a reload) stays the holder and is read again at the health pace (``read_s``): asleep, the GPU is
free; awake and serving, it is put to sleep if another model waits (or a /sleep of ours may still
be running), else marked ready; unknown, the group waits for it, saying so in ``last_error``.
Only the group marks a ``url:`` member ready (the poller does not: it cannot ask /is_sleeping).
After a wake of ours that failed or went unanswered (``Member.wake_unsure``), "asleep" is no
proof: vLLM's /is_sleeping says true while any tag sleeps, so a level-2 wake that failed after
``tags=weights`` leaves the weights on the GPU. Such a member is sent a plain /wake_up (its
remaining tags), then /sleep, and frees the GPU only once that /sleep answers.

Start-up: ``url:`` members are asked ``/is_sleeping``; the first awake one keeps the GPU and any
other awake one is put to sleep. Every other ``url:`` member not read as asleep (unreachable, or
its /sleep failed) is *in doubt*; so is one that a switch found unreachable. Members in doubt are
read again at the same pace (asleep: out of doubt; awake: put to sleep), and no switch wakes a
member while another is in doubt (the target's ``last_error`` names the one it waits for). Launched
members start one after another, each put to sleep once ready (vLLM sizes its KV cache from the
free memory it finds), the group's first one last, so it ends awake. Then the loop: every
``tick_s`` the policy (``policy.py``) says whose turn it is, and an idle holder with
``sleep.idle_s`` is put to sleep; a step is skipped while ``fence`` says no (with Redis: this
gateway's claim on the group may have lapsed, ``gateway/swap_lease.py``), and a switch (an
admin's too) asks it first and again before it wakes its target (the old holder's sleep may
have outlasted the claim).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace

from gpupool.workers.registry import SLEEP_STATES, Worker, WorkerState
from gpupool.workers.swap import calls, reading
from gpupool.workers.swap.demand import ModelDemand
from gpupool.workers.swap.member import GroupSeams, Member, state_of
from gpupool.workers.swap.memory import DeviceWatch, Freed
from gpupool.workers.swap.policy import Holder, next_model
from gpupool.workers.swap.reading import Seen

log = logging.getLogger("gpupool.swap")

_POLL_S = 0.05
SWITCH_GUESS_S = 2.0  # the switch time assumed until one is measured (vLLM level 1: ~1.2 s)
_SMOOTH = 0.3  # the weight of the newest switch in the running estimate
_UP = (WorkerState.ready, WorkerState.failed)


class SwapGroup:
    def __init__(self, name: str, members: list[Member], seams: GroupSeams) -> None:
        self.name = name
        self.members = members
        self.seams = seams
        self.holder: Member | None = None
        self.lock = asyncio.Lock()
        self.starting_up = True
        # whether this gateway may act on the group now (its Redis claim fresh: swap_lease.py)
        self.fence: Callable[[], bool] = lambda: True
        self._fenced = False
        self._leaving: Member | None = None  # the holder while it falls asleep
        self._awake_since = time.monotonic()
        self._last_active = time.monotonic()
        self._seen_total = -1
        self._read_at = 0.0  # a url: holder in doubt is read again from then (``_reread``)
        # url: members other than the holder that may be awake (never read as asleep): no
        # other member wakes while one is here; read again at the same pace (``_reread_doubt``)
        self._doubt: set[str] = set()
        self._doubt_read_at = 0.0
        # the switches: how many, the last one's end (wall clock) and seconds, and the
        # policy's estimate of one (``switch_s``: a guess until the first is measured)
        self.switches = 0
        self.last_switch_at: float | None = None
        self.last_switch_s: float | None = None
        self.switch_s = SWITCH_GUESS_S

    # -- what it shows -------------------------------------------------------------------------

    def awake_model(self) -> str | None:
        """The model of the member that serves now (ready), if any."""
        h = self.holder
        return h.worker.model if h is not None and h.worker.state is WorkerState.ready else None

    def expected_wait(self, model: str) -> float:
        """Seconds until a request for ``model`` (asleep) may be served: the switch's, plus,
        under ``weighed``, what the bound may still keep it waiting (an estimate)."""
        turns, now = self.seams.turns, time.monotonic()
        wait = self.switch_s
        h = self.holder
        if h is None or h.worker.model == model:
            return wait  # the GPU is free, or the switch to it is under way
        if h.worker.inflight or self.seams.demand.count(h.worker.model):
            d = self.seams.demand.of(model, now)
            waited = d.oldest_s if d is not None else 0.0
            if turns.policy == "weighed":
                wait = max(wait, turns.max_wait_s - waited)
            else:
                wait += max(0.0, turns.min_awake_s - (now - self._awake_since))
        return wait

    def view(self) -> dict[str, object]:
        """For ``/admin/workers``' ``groups`` and ``gpupool status``."""
        h = self.holder
        models = sorted({m.worker.model for m in self.members})
        return {
            "name": self.name,
            "holder": h.worker.name if h is not None else None,
            "holder_state": h.worker.state.value if h is not None else None,
            "members": [m.worker.name for m in self.members],
            "waiting": {model: self.seams.demand.count(model) for model in models},
            "switches": self.switches,
            "last_switch_at": self.last_switch_at,
            "last_switch_s": None if self.last_switch_s is None else round(self.last_switch_s, 2),
            "switch_estimate_s": round(self.switch_s, 2),
            "switch_measured": self.last_switch_s is not None,
            "policy": self.seams.turns.policy,
        }

    def _holder_view(self, now: float) -> Holder | None:
        h = self.holder
        if h is None:
            return None
        w = h.worker
        idle = 0.0 if w.inflight else now - max(self._last_active, self._awake_since)
        return Holder(w.model, now - self._awake_since, w.inflight > 0, w.inflight, idle)

    def reversal(self, m: Member) -> str | None:
        """After an admin's sleep or wake of ``m``: what the policy will undo, and why (None:
        it stands). Said in the admin call's result, so that an undone action is no mystery."""
        now = time.monotonic()
        demand = self._demand(now)
        if m.worker.state is WorkerState.asleep:
            d = demand.get(m.worker.model)
            if d is None or not d.count:
                return None
            return (f"{d.count} request(s) wait for `{m.worker.model}`: the swap policy "
                    f"({self.seams.turns.policy}) wakes it again")  # fmt: skip
        view = self._holder_view(now)
        if self.holder is not m or view is None:
            return None
        view = replace(view, idle_s=float("inf"))  # (an anticipation delays it, no more)
        model = next_model(view, demand, self.seams.turns, self.switch_s)
        if model is None:
            return None
        waiting = demand[model].count
        return (f"{waiting} request(s) wait for `{model}`: the swap policy "
                f"({self.seams.turns.policy}) gives the GPU back to it next")  # fmt: skip

    def member(self, name: str) -> Member | None:
        return next((m for m in self.members if m.worker.name == name), None)

    # -- seams for the supervisor and the poller ----------------------------------------------

    def may_run(self, member: Member) -> bool:
        """Whether ``member`` may use the GPU now (launch, or be marked ready by the poller)."""
        free = self.holder is None and not self._doubt
        if free and not self.starting_up and not self.lock.locked():
            self.holder = member  # a free GPU: a relaunch after a failure takes it
            self._awake_since = time.monotonic()
        return self.holder is member and self._leaving is not member

    def refresh(self) -> None:
        """Follow the registry's entries: a reload replaces a changed worker's (same name)."""
        for m in self.members:
            current = self.seams.registry.get(m.worker.name)
            if current is not None and current is not m.worker:
                current.swap_group = self.name
                m.worker = current

    async def before_launch(self, member: Member) -> None:
        """The launch gate: return once ``member`` holds the GPU."""
        self.refresh()
        while not self.may_run(member):
            member.worker.last_error = f"waiting for its turn on the GPU (swap group {self.name})"
            await asyncio.sleep(_POLL_S * 2)
        if member.worker.last_error and member.worker.last_error.startswith("waiting for its turn"):
            member.worker.last_error = None

    # -- start-up and the loop ----------------------------------------------------------------

    async def run(self) -> None:
        try:
            async with self.lock:
                await self._start_up()
        finally:
            self.starting_up = False
        while True:
            await asyncio.sleep(self.seams.tick_s)
            if not self._may_act():
                continue
            try:
                async with self.lock:
                    await self._step()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must not stop the group's turns for good
                log.exception("swap group %s: step failed", self.name)

    def _may_act(self) -> bool:
        """False while this gateway's claim on the group may have lapsed (``fence``): another
        replica may control it; said once in the log."""
        ok = self.fence()
        if ok == self._fenced:
            if ok:
                log.warning("swap group %s: its claim is renewed again; switching resumes",
                            self.name)  # fmt: skip
            else:
                log.warning("swap group %s: its claim was not renewed in time (Redis out of "
                            "reach?): no switch until it is", self.name)  # fmt: skip
            self._fenced = not ok
        return ok

    async def _start_up(self) -> None:
        remote = [m for m in self.members if not m.launched]
        awake = await asyncio.gather(*(self._read_remote(m) for m in remote))
        for m, is_awake in zip(remote, awake, strict=True):
            if not is_awake:
                continue
            if self.holder is None:
                self.holder = m
                self._mark_ready(m)
            else:
                log.info("swap group %s: %s is awake too; putting it to sleep", self.name,
                         m.worker.name)  # fmt: skip
                await self._sleep_call(m)
        self._doubt = {
            m.worker.name
            for m in remote
            if m is not self.holder and m.worker.state is not WorkerState.asleep
        }
        self._doubt_read_at = time.monotonic() + self.seams.read_s
        launched = [m for m in self.members if m.launched]
        if not launched or self._doubt:
            return  # (launched ones wait at their gates until no url: member is in doubt)
        last = launched[0] if self.holder is None else None
        for m in [x for x in launched if x is not last] + ([last] if last else []):
            old = self.holder
            if old is not None and old is not m:
                freed = await self._put_to_sleep(old)
                if not freed and not old.launched:
                    break  # a url: one that may be awake: the rest wait at their gates
            self.holder = m
            self._awake_since = time.monotonic()
            await self._until(m.worker, _UP)
            if m is not last and m.worker.state is WorkerState.ready:
                await self._put_to_sleep(m)
        h = self.holder
        if h is not None and h.launched and h.worker.state is not WorkerState.ready:
            self.holder = None

    async def _read_remote(self, m: Member) -> bool:
        """A ``url:`` member's window and sleep state; True when it is awake and serving."""
        seen = await self._read(m)
        if seen.seen is Seen.asleep:
            self.seams.registry.transition(m.worker, WorkerState.asleep)
        return seen.seen is Seen.awake

    async def _read(self, m: Member) -> reading.Reading:
        """What a ``url:`` member says of itself; its window, or the error kept in last_error."""
        w, seams = m.worker, self.seams
        assert w.url is not None
        seen = await reading.read(seams.session, w.url, w.model, seams.probe_timeout_s)
        if seen.seen is Seen.awake:
            w.max_model_len = seen.max_model_len
        elif seen.seen is Seen.unknown:
            w.last_error = seen.error
        return seen

    async def _step(self) -> None:
        self.refresh()
        await self._reread_doubt(time.monotonic())
        h, now = self.holder, time.monotonic()
        if h is not None and h.worker.state is not WorkerState.ready:
            if not h.launched:
                await self._reread(h, now)  # it may still hold the GPU: free once known asleep
            elif h.worker.state in (WorkerState.failed, WorkerState.stopped):
                self.holder = None  # its process is gone: GPU free
            return  # else (re)starting: let it come up
        if h is not None and (h.worker.inflight or h.worker.requests_total != self._seen_total):
            self._last_active, self._seen_total = now, h.worker.requests_total
        demand = self._demand(now)
        model = next_model(self._holder_view(now), demand, self.seams.turns, self.switch_s)
        target = self._target(model) if model is not None else None
        if target is not None:
            await self.switch_to(target)
        elif self._idle_for(h, demand, now):
            assert h is not None
            log.info("swap group %s: %s idle for %g s; sleeping", self.name, h.worker.name,
                     h.idle_s)  # fmt: skip
            await self._put_to_sleep(h)

    async def _reread(self, h: Member, now: float) -> None:
        """A ``url:`` holder out of ``ready``: read it again, at the health pace."""
        state = h.worker.state
        if state is WorkerState.asleep:
            self.holder = None
            return
        if state in SLEEP_STATES or state is WorkerState.draining or now < self._read_at:
            return  # (a drain lets its requests finish first)
        others = any(
            model != h.worker.model and self._target(model) is not None
            for model in self._demand(now)
        )
        await self._settle(h, sleep=others)

    async def _reread_doubt(self, now: float) -> None:
        """Read the ``url:`` members in doubt again, at the health pace: asleep (proved), out of
        doubt; awake, put to sleep (out once its /sleep answers); unknown, still in doubt."""
        if not self._doubt or now < self._doubt_read_at:
            return
        for m in [x for x in self.members if x.worker.name in self._doubt]:
            if m is self.holder or await self._settle(m, sleep=True):
                self._doubt.discard(m.worker.name)  # (the holder is read by ``_reread``)
        self._doubt_read_at = time.monotonic() + self.seams.read_s
        for m in self.members if not self._doubt else ():
            if (m.worker.last_error or "").startswith(self._waits_for):
                m.worker.last_error = None  # (a switch that waited for one in doubt)

    @property
    def _waits_for(self) -> str:
        return f"swap group {self.name} waits for "

    def _doubter(self, target: Member) -> str | None:
        """A member other than ``target`` that may be awake: no switch wakes ``target`` then.
        (Not the holder: ``_reread`` settles a holder in doubt before any switch.)"""
        skip = {target.worker.name, self.holder.worker.name if self.holder else ""}
        return next((n for n in sorted(self._doubt) if n not in skip), None)

    def _idle_for(self, h: Member | None, demand: dict[str, ModelDemand], now: float) -> bool:
        """Whether the holder has been idle for its ``sleep.idle_s``."""
        if h is None or h.idle_s is None or h.worker.model in demand:
            return False
        return now - self._last_active >= h.idle_s

    def _demand(self, now: float) -> dict[str, ModelDemand]:
        out = {}
        for model in {m.worker.model for m in self.members}:
            d = self.seams.demand.of(model, now)
            if d is not None:
                out[model] = d
        for m in self.members:  # paused requests: waiting for their model since the pause
            w = m.worker
            if w.paused_since is None or not w.inflight or w.state is WorkerState.ready:
                continue
            age = now - w.paused_since
            kept = ModelDemand(w.paused, age, self.seams.demand.best_running(w.name),
                               w.paused * age)  # fmt: skip
            out[w.model] = _merged(out.get(w.model), kept)
        return out

    def _target(self, model: str) -> Member | None:
        """The member to wake for ``model``: an asleep one, else one waiting at its gate."""
        members = sorted(self.members, key=lambda m: not m.worker.paused)  # its paused first
        for states in ((WorkerState.asleep,), (WorkerState.starting, WorkerState.failed)):
            for m in members:
                w = m.worker
                if w.model != model or w.state not in states:
                    continue
                if w.state is WorkerState.failed and m.launched:
                    continue  # supervision gave up on it
                return m
        return None

    # -- switching ----------------------------------------------------------------------------

    async def switch_to(self, target: Member) -> bool:
        """Give the GPU to ``target`` (caller holds the lock). True when it ends ready."""
        t0 = time.monotonic()
        old = self.holder
        if old is target and target.worker.state is WorkerState.ready:
            return True
        if not self._may_act():
            return False  # (an admin wake: another replica may control the group)
        blocker = self._doubter(target)
        if blocker is not None:
            target.worker.last_error = f"{self._waits_for}{blocker}: it may be awake"
            return False
        if (target.worker.last_error or "").startswith(self._waits_for):
            target.worker.last_error = None
        if old is not None and old is not target and not await self._put_to_sleep(old, True):
            return False
        if not self._may_act():
            return False  # the sleep outlasted this gateway's claim: another may wake one now
        self.holder = target
        self._awake_since = time.monotonic()
        if not await self._wake(target, held=old is target):
            return False
        self._awake_since = self._last_active = time.monotonic()
        self._measured(self._awake_since - t0)
        waited = self.seams.demand.count(target.worker.model)
        log.info("swap group %s: %s awake after %.2f s (%d waiting)", self.name,
                 target.worker.name, self._awake_since - t0, waited)  # fmt: skip
        self.seams.events.switched(self.name, target.worker.model, self._awake_since - t0, waited)
        return True

    def _measured(self, seconds: float) -> None:
        first = self.last_switch_s is None
        self.switches += 1
        self.last_switch_at, self.last_switch_s = time.time(), seconds
        self.switch_s = seconds if first else (1 - _SMOOTH) * self.switch_s + _SMOOTH * seconds

    async def put_to_sleep(self, m: Member) -> bool:
        """Admin: put ``m`` to sleep if it holds the GPU (caller holds the lock); not while
        fenced (another replica may control the group: ``m`` may be its holder)."""
        if not self._may_act():
            return False
        if self.holder is not m:
            return m.worker.state is WorkerState.asleep
        return await self._put_to_sleep(m)

    async def _put_to_sleep(self, m: Member, switch: bool = False) -> bool:
        """Stop new requests, let the running ones finish (a ``switch`` pauses them after
        ``pause_after_s``), /sleep. True when the GPU is free."""
        w, registry = m.worker, self.seams.registry
        self._leaving = m
        try:
            if w.state in (WorkerState.starting, WorkerState.warming) and m.launched:
                await self._until(w, (*_UP, WorkerState.stopped))
            if w.state is WorkerState.ready:
                registry.transition(w, WorkerState.falling_asleep)
                keep = await self._drain(w, self.seams.pause_after_s if switch else None)
                if state_of(w) is WorkerState.falling_asleep:
                    if keep:
                        self._pause(m)
                    freed = await self._sleep_call(m, keep)
                    if not freed:
                        return False
                elif not m.launched:
                    return False  # drained meanwhile, still awake: read again (``_reread``)
            elif w.state is WorkerState.draining and not m.launched:
                return False  # its requests finish first
            elif w.state is not WorkerState.asleep and not m.launched:
                return await self._settle(m, sleep=True)
            self.holder = None if self.holder is m else self.holder
            return True
        finally:
            self._leaving = None

    async def _drain(self, w: Worker, pause_after_s: float | None) -> bool:
        """Wait for ``w``'s running requests to end while it falls asleep; True when some still
        run after ``pause_after_s`` (they are to be paused)."""
        registry = self.seams.registry
        deadline = None if pause_after_s is None else time.monotonic() + pause_after_s
        while w.inflight > 0 and state_of(w) is WorkerState.falling_asleep:
            left = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
            if left <= 0:
                return True
            await registry.wait_idle(w, left)
        return False

    def _pause(self, m: Member) -> None:
        """Its running requests are paused from now (asked of vLLM next, ``mode=keep``)."""
        w = m.worker
        w.paused_since = time.monotonic()
        log.info("swap group %s: pausing %d request(s) on %s after %g s", self.name,
                 w.inflight, w.name, self.seams.pause_after_s)  # fmt: skip
        self.seams.events.paused(self.name, w.model, w.inflight)

    async def _sleep_call(self, m: Member, keep: bool = False) -> bool:
        verifier, level = self.seams.verifier, m.next_level or m.level
        awake = None
        if verifier is not None:
            awake = await verifier.before_sleep(m.worker, m.verify, level)
        error = await calls.ask_sleep(self.seams, m, keep=keep)
        if error is None and verifier is not None:  # (url: members: their GPU, if known)
            error = await verifier.after_sleep(m.worker, m.verify, awake)
        if error is not None:
            return await self._failed(m, error)
        w = m.worker
        if m.launched and w.state in (WorkerState.falling_asleep, WorkerState.ready):
            self.seams.registry.transition(w, WorkerState.asleep)
        elif not m.launched and w.state not in (WorkerState.stopped, WorkerState.draining):
            self.seams.registry.transition(w, WorkerState.asleep)  # (not if drained meanwhile)
        return True

    async def _settle(self, m: Member, sleep: bool) -> bool:
        """Read a ``url:`` holder in doubt: asleep, the GPU is free (True); awake, put it to
        sleep if ``sleep`` or a /sleep of ours may still run, else mark it ready (a drained one
        stays out); unknown, keep waiting for it."""
        w = m.worker
        self._read_at, before = time.monotonic() + self.seams.read_s, w.state
        seen = await self._read(m)
        unsure = seen.seen is Seen.asleep and m.wake_unsure  # its weights may be awake
        if state_of(w) is not before:
            return False  # drained (or undrained) while it was read: its answer is stale
        if seen.seen is Seen.unknown:
            w.last_error = self._waiting(m, seen.error or "no answer")
            return False
        if seen.seen is Seen.awake and not (sleep or m.sleep_asked):
            if w.state is not WorkerState.stopped:
                w.last_error = None
                self._mark_ready(m)
            return False
        if unsure and self.holder not in (m, None):
            w.last_error = "a wake failed half-way; it is read again once the GPU is free"
            return False  # (not reached: such a member holds the GPU until it is settled)
        if seen.seen is Seen.awake or unsure:
            error = await calls.ask_sleep(self.seams, m, wake_first=unsure)
            if error is not None:
                log.warning("swap group %s: worker %s: %s", self.name, w.name, error)
                w.last_error = self._waiting(m, error)
                return False
        if not await self._has_room(m):
            return False
        m.sleep_asked, w.last_error = False, None
        if w.state is not WorkerState.stopped:
            self.seams.registry.transition(w, WorkerState.asleep)
        self.holder = None if self.holder is m else self.holder
        return True

    async def _has_room(self, m: Member) -> bool:
        """Whether a ``url:`` member read as asleep left its GPU room for the others (one
        read of its ``DeviceWatch``; True when there is none, or it cannot be read)."""
        watch = m.verify.watch
        if not isinstance(watch, DeviceWatch):
            return True
        check = await watch.until_freed(m.worker, None, wait=False)
        if check.freed is not Freed.held:
            return True
        m.worker.last_error = self._waiting(m, watch.held(check))
        return False

    def _waiting(self, m: Member, reason: str) -> str:
        """``last_error`` of a ``url:`` member that may hold the GPU."""
        if self.holder is not m:
            return reason
        return f"{reason} (swap group {self.name} waits for it: it may still hold the GPU)"

    async def _wake(self, m: Member, held: bool) -> bool:
        w, seams = m.worker, self.seams
        if w.state is WorkerState.asleep and w.url is not None:
            seams.registry.transition(w, WorkerState.waking)
            level = m.slept_at or m.level
            error = await calls.send_wake(self.seams, m)
            if error is not None:
                await self._failed(m, error)
                if m.launched:  # restarted: it comes up awake, as its turn goes on
                    await self._until(w, _UP)
                return state_of(w) is WorkerState.ready
            if state_of(w) is WorkerState.waking and await self._checked(m, level):
                self._mark_ready(m)
            return state_of(w) is WorkerState.ready
        if m.launched:  # at its launch gate (or restarting): now its turn
            await self._until(w, _UP)
            return state_of(w) is WorkerState.ready
        return await self._wake_remote(m, held)

    async def _wake_remote(self, m: Member, held: bool) -> bool:
        """A ``url:`` member that was out (starting, failed): read it, wake it if it sleeps.
        ``held``: it held the GPU before this switch (whatever it answers, it may be awake)."""
        w, before = m.worker, m.worker.state
        seen = await self._read(m)
        if seen.seen is Seen.unknown:
            if held:
                w.last_error = self._waiting(m, w.last_error or "no answer")
            else:  # nothing was sent to it, but it was never known asleep: it may be awake
                self.holder = None
                self._doubt.add(w.name)
            return False
        if seen.seen is Seen.asleep:
            level = m.slept_at or m.level
            error = await calls.send_wake(self.seams, m)
            if error is not None:
                await self._failed(m, error)
                return False
            if not await self._checked(m, level):
                return False
        if state_of(w) is not before:
            return False  # drained meanwhile: it holds the GPU, out of routing
        w.last_error = None
        self._mark_ready(m)
        return True

    async def _checked(self, m: Member, level: int) -> bool:
        """After a wake at ``level``: True when its canary matches (or none applies). Else a
        launched member is restarted (its turn goes on: it comes up awake) and a ``url:`` one
        is put back to sleep (the GPU free; its model waits for the next try)."""
        verifier, w = self.seams.verifier, m.worker
        why = None if verifier is None else await verifier.after_wake(w, m.verify, level)
        if why is None:
            return True
        if m.launched:
            await self._failed(m, f"{why}: restarted")
            await self._until(w, _UP)
            return False
        error = await calls.ask_sleep(self.seams, m)
        if error is not None:
            await self._failed(m, f"{why}; {error}")
            return False
        log.warning("swap group %s: worker %s: %s; put back to sleep", self.name, w.name, why)
        w.last_error = f"{why}; put back to sleep"
        if state_of(w) is not WorkerState.stopped:
            self.seams.registry.transition(w, WorkerState.asleep)
        self.holder = None if self.holder is m else self.holder
        return False

    def _mark_ready(self, m: Member) -> None:
        m.worker.consecutive_failures = 0
        m.sleep_asked = m.wake_unsure = False
        self._doubt.discard(m.worker.name)  # (known awake: the group's holder)
        self.seams.registry.transition(m.worker, WorkerState.ready)

    async def _failed(self, m: Member, reason: str) -> bool:
        """Mark ``m`` failed; restart a launched one. True when its GPU memory is free (a
        ``url:`` one's never is: it stays the holder, read again from ``_reread``)."""
        w = m.worker
        log.warning("swap group %s: worker %s: %s", self.name, w.name, reason)
        w.last_error = reason if m.launched else self._waiting(m, reason)
        self.seams.registry.transition(w, WorkerState.failed)
        if not m.launched:
            self._read_at = time.monotonic() + self.seams.read_s
            return False
        if self.seams.restart is None:
            return False
        await self.seams.restart(w.name)  # kills the process: its memory is free
        await self._until(w, (WorkerState.starting, WorkerState.warming, *_UP), 10.0)
        return True

    async def _until(
        self, w: Worker, states: tuple[WorkerState, ...], timeout_s: float | None = None
    ) -> None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while w.state not in states:
            if deadline is not None and time.monotonic() >= deadline:
                return
            await asyncio.sleep(_POLL_S)


def _merged(a: ModelDemand | None, b: ModelDemand) -> ModelDemand:
    if a is None:
        return b
    priority = min(a.best_priority, b.best_priority)
    total = a.total_age_s + b.total_age_s
    return ModelDemand(a.count + b.count, max(a.oldest_s, b.oldest_s), priority, total)
