"""What the simulated model says: echo, lorem or a fixed script, cut into output tokens."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from gpupool.workers.sim.config import SimConfig
from gpupool.workers.sim.tokenize import LOREM, Tokenizer


@dataclass(slots=True)
class Output:
    """One choice's output tokens and why it ended."""

    pieces: list[str]
    finish_reason: str  # "stop" | "length"


class TextSource:
    def __init__(self, config: SimConfig, tokenizer: Tokenizer) -> None:
        self.mode = config.mode
        self.output_tokens = config.output_tokens
        self._tokenizer = tokenizer
        # True while the "weights" are wrong (sleep.py's reload_fail "garbage"): every output
        # is "!" pieces, as vLLM's after a level-2 wake without a correct reload
        self.garbled: Callable[[], bool] = lambda: False
        self._lorem = [LOREM[0], *(" " + w for w in LOREM[1:])]
        self._lorem_wrap = [" " + w for w in LOREM]
        script = config.script or ""
        if config.script_chunking == "chars":
            self._script = chunk_chars(script, random.Random(config.seed))
        else:
            self._script = tokenizer.pieces(script)

    def natural(self, echo_text: str, choice: int) -> list[str]:
        """The pieces the model would say if nothing cut it short."""
        if self.mode == "echo":
            return self._tokenizer.pieces(echo_text)
        if self.mode == "script":
            return self._script
        return self._lorem_pieces(self.output_tokens, choice)

    def plan(self, echo_text: str, max_tokens: int, choice: int, prefix: str = "") -> Output:
        """The output of one choice under ``max_tokens``; ``prefix`` is already written
        (``continue_final_message``) and is skipped when the natural text starts with it."""
        pieces = self.natural(echo_text, choice)
        if self.garbled():
            pieces = ["!"] * len(pieces)
        if prefix:
            pieces = drop_prefix(pieces, prefix)
        if len(pieces) > max_tokens:
            return Output(pieces[:max_tokens], "length")
        return Output(pieces, "stop")

    def written(self, prompt: str, choice: int) -> str:
        """The start of this choice's text that ``prompt`` already ends with (whole pieces):
        a completions prompt that carries the first part of an answer (a request migrated
        from another worker) is continued, as a model continues its own text. Echo mode
        answers the prompt itself, so nothing is taken as written."""
        if self.mode == "echo" or not prompt:
            return ""
        pieces = self.natural(prompt, choice)
        best, upto = "", ""
        for piece in pieces:
            upto += piece
            if len(upto) > len(prompt):
                break
            if prompt.endswith(upto):
                best = upto
        return best

    def _lorem_pieces(self, n: int, offset: int) -> list[str]:
        size = len(LOREM)
        if offset == 0 and n <= size:
            return self._lorem[:n]
        first = LOREM[offset % size]
        return [first, *(self._lorem_wrap[(offset + i) % size] for i in range(1, n))]


def chunk_chars(text: str, rng: random.Random) -> list[str]:
    """Pieces of one to three characters, as guided decoding emits forced text."""
    out: list[str] = []
    i = 0
    while i < len(text):
        step = rng.randint(1, 3)
        out.append(text[i : i + step])
        i += step
    return out


def drop_prefix(pieces: list[str], prefix: str) -> list[str]:
    """The pieces after ``prefix``; all of them when they do not start with it."""
    if not "".join(pieces).startswith(prefix):
        return pieces
    consumed = 0
    for i, piece in enumerate(pieces):
        end = consumed + len(piece)
        if end > len(prefix):
            return [piece[len(prefix) - consumed :], *pieces[i + 1 :]]
        consumed = end
    return []
