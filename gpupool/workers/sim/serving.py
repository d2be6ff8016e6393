"""Running a :class:`Job` on the engine: streamed as vLLM's SSE, or as one JSON body.

A request the engine aborts (a ``/sleep`` with ``mode=abort``) ends as vLLM's does: a stream
gets, for each choice still going, a chunk with an empty delta and ``finish_reason: "abort"``,
then its usage (if asked) and ``[DONE]``; a whole body is a 200 with what was made by then.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterator
from typing import Any, Protocol

from gpupool.workers.sim import render
from gpupool.workers.sim.engine import Engine
from gpupool.workers.sim.faults import Knobs
from gpupool.workers.sim.jobs import Job
from gpupool.workers.sim.reasoning import Qwen3Splitter, prompt_ends_reasoning, split_all


class StreamFormat(Protocol):
    """One endpoint's chunks. ``chunk``'s ``done`` is the choice's token count so far when the
    client asked for continuous usage, else None."""

    writer: render.ChunkWriter

    def opening(self) -> list[bytes]: ...

    def chunk(
        self, index: int, piece: str, last: bool, finish: str | None, done: int | None
    ) -> bytes | None: ...

    def aborted(self, index: int, done: int | None) -> bytes:
        """The choice's last chunk when the engine aborted it: nothing new, ``abort``."""

    @property
    def reasoning_tokens(self) -> int | None: ...


class StepIds:
    """The ids each choice's chunks carry when the request asked (``return_token_ids``), as
    vLLM writes them: the prompt's once, then each step's own (a piece a token here)."""

    def __init__(self, job: Job) -> None:
        self.prompt = job.prompt_ids
        self._outputs = job.output_ids
        self._at = [0] * len(job.outputs)

    def step(self, index: int, piece: str) -> list[int] | None:
        if self._outputs is None:
            return None
        if not piece:
            return []
        at = self._at[index]
        self._at[index] += 1
        return self._outputs[index][at : at + 1]

    def first(self, index: int) -> bool:
        return self._at[index] == 0


class ChatFormat:
    """Chat chunks: a role chunk per choice, then content (and reasoning) deltas."""

    def __init__(self, job: Job) -> None:
        self.ids = StepIds(job)
        self.writer = _writer(job, "chat.completion.chunk")
        self._n = len(job.outputs)
        self._prompt_tokens = job.prompt_tokens
        self._keep_reasoning = job.include_reasoning
        self._splitters: list[Qwen3Splitter] | None = None
        self._reasoning = [0] * self._n
        if job.thinking is not None:
            start = job.thinking and not prompt_ends_reasoning(job.prompt)
            self._splitters = [Qwen3Splitter(start) for _ in job.outputs]

    def opening(self) -> list[bytes]:
        return [self.writer.role(i, self.ids.prompt) for i in range(self._n)]

    def chunk(
        self, index: int, piece: str, last: bool, finish: str | None, done: int | None
    ) -> bytes | None:
        ids = self.ids.step(index, piece)
        delta = self._delta(index, piece, last)
        if not delta and finish is None and ids is None:
            return None  # with ids asked, vLLM sends the step's ids with an empty delta
        return self.writer.chat_delta(index, delta, finish, self._use(index, done), ids)

    def aborted(self, index: int, done: int | None) -> bytes:
        ids = self.ids.step(index, "")
        return self.writer.chat_delta(index, {}, "abort", self._use(index, done), ids)

    def _use(self, index: int, done: int | None) -> dict[str, Any] | None:
        if done is None:
            return None
        reasoning = None if self._splitters is None else self._reasoning[index]
        return render.chat_running_usage(self._prompt_tokens, done, reasoning)

    @property
    def reasoning_tokens(self) -> int | None:
        return None if self._splitters is None else sum(self._reasoning)

    def _delta(self, index: int, piece: str, last: bool) -> dict[str, str]:
        if self._splitters is None:
            return {"content": piece}
        splitter = self._splitters[index]
        self._reasoning[index] += splitter.in_reasoning and bool(piece)
        reasoning, content = splitter.feed(piece)
        if last:
            more_r, more_c = splitter.flush()
            reasoning, content = reasoning + more_r, content + more_c
        delta: dict[str, str] = {}
        if reasoning and self._keep_reasoning:
            delta["reasoning"] = reasoning
        if content:
            delta["content"] = content
        return delta


class TextFormat:
    """Completion chunks: text deltas only."""

    reasoning_tokens = None

    def __init__(self, job: Job) -> None:
        self.ids = StepIds(job)
        self.writer = _writer(job, "text_completion")
        self._prompt_tokens = job.prompt_tokens
        self._sent = [False] * len(job.outputs)  # a choice's first chunk went out

    def opening(self) -> list[bytes]:
        return []

    def chunk(
        self, index: int, piece: str, last: bool, finish: str | None, done: int | None
    ) -> bytes | None:
        use = None if done is None else render.usage(self._prompt_tokens, done)
        return self.writer.text_delta(index, piece, finish, use, self._ids(index, piece))

    def aborted(self, index: int, done: int | None) -> bytes:
        use = None if done is None else render.usage(self._prompt_tokens, done)
        return self.writer.text_delta(index, "", "abort", use, self._ids(index, ""))

    def _ids(self, index: int, piece: str) -> tuple[list[int] | None, list[int] | None]:
        prompt = None if self._sent[index] else self.ids.prompt
        self._sent[index] = True
        return prompt, self.ids.step(index, piece)


def _writer(job: Job, obj: str) -> render.ChunkWriter:
    return render.ChunkWriter(
        job.response_id, obj, job.created, job.model, job.fingerprint, job.include_usage
    )


async def stream(
    engine: Engine, knobs: Knobs, job: Job, fmt: StreamFormat
) -> AsyncGenerator[bytes, None]:
    """The SSE body. Token ``k`` of every choice goes out together, paced by the engine."""
    counts = [0] * len(job.outputs)
    steps = job.steps
    async with engine.running(job.admission) as run:
        step = 0
        while step < steps:
            knobs.check_crash(step)
            await run.pace(step)
            parts = fmt.opening() if step == 0 else []
            if run.aborted:
                yield b"".join(parts + _abort_chunks(fmt, job, step, counts))
                break
            upto = run.available(step, steps)  # the GPU engine makes several a step: one write
            for at in range(step, upto):
                if at > step:
                    knobs.check_crash(at)
                parts.extend(_step_chunks(fmt, job, at, counts))
            run.generated = sum(counts)
            yield b"".join(parts)
            step = upto
        if not run.aborted:
            knobs.check_crash(steps)
        run.finish_reasons = job.finish_reasons
    if job.include_usage:
        use = render.usage(job.prompt_tokens, sum(counts), fmt.reasoning_tokens)
        yield fmt.writer.usage(use)
    yield render.DONE


def _abort_chunks(fmt: StreamFormat, job: Job, step: int, counts: list[int]) -> list[bytes]:
    """The last chunk of every choice not finished before position ``step``."""
    unfinished = [i for i, out in enumerate(job.outputs) if step < max(len(out.pieces), 1)]
    cont = job.continuous_usage
    return [fmt.aborted(i, counts[i] if cont else None) for i in unfinished]


def _step_chunks(fmt: StreamFormat, job: Job, step: int, counts: list[int]) -> Iterator[bytes]:
    for i, out in enumerate(job.outputs):
        size = len(out.pieces)
        if step >= max(size, 1):
            continue
        last = step >= size - 1
        piece = out.pieces[step] if size else ""
        counts[i] += 1 if size else 0
        done = counts[i] if job.continuous_usage else None
        chunk = fmt.chunk(i, piece, last, out.finish_reason if last else None, done)
        if chunk is not None:
            yield chunk


async def run_full(engine: Engine, job: Job) -> None:
    """Hold a slot for as long as the whole output takes."""
    async with engine.running(job.admission) as run:
        await run.pace_all(job.steps)
        if run.aborted:
            _cut(job, run.made(job.steps))
        run.generated = job.generated
        run.finish_reasons = job.finish_reasons


def _cut(job: Job, made: int) -> None:
    """An aborted job keeps the first ``made`` positions of each choice; the choices that
    had not finished by then end with ``abort``."""
    for out in job.outputs:
        if made < max(len(out.pieces), 1):
            out.pieces, out.finish_reason = out.pieces[:made], "abort"


def chat_body(job: Job) -> bytes:
    choices = []
    reasoning_total: int | None = None if job.thinking is None else 0
    for i, out in enumerate(job.outputs):
        reasoning: str | None = None
        content: str | None = "".join(out.pieces)
        if job.thinking is not None:
            reasoning, content, tokens = split_all(out.pieces, job.thinking)
            reasoning_total = (reasoning_total or 0) + tokens
            reasoning = reasoning if job.include_reasoning else None
        message = render.chat_message(content, reasoning)
        choices.append(render.chat_choice(i, message, out.finish_reason))
    use = render.full_usage(job.prompt_tokens, job.generated, reasoning_total)
    return render.chat_body(job.response_id, job.created, job.model, choices, use, job.fingerprint)


def completion_body(job: Job) -> bytes:
    choices = [
        render.completion_choice(i, "".join(out.pieces), out.finish_reason)
        for i, out in enumerate(job.outputs)
    ]
    use = render.full_usage(job.prompt_tokens, job.generated, None)
    return render.completion_body(
        job.response_id, job.created, job.model, choices, use, job.fingerprint
    )
