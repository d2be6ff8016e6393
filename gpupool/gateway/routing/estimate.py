"""How many tokens a prompt's bytes hold, learned per model from what the workers said.

Routing places a prompt that is clear of every window's edge without counting it (a count is a
round trip to a worker): by an estimate, its bytes over a bytes-per-token figure. The figure starts
at 3 (English runs about 4 bytes a token with its JSON around it, CJK about 3 in UTF-8) and only
goes down: when a worker shows that a prompt held more tokens than that (an exact count, or a
context-length 400, which proves at least ``window + 1 - max_tokens``), the figure becomes that
prompt's own ratio, so the next prompt like it is placed by a truer estimate (or, near a window's
edge, counted) instead of being sent to a window too small and moved. Never below 1 byte a token.
Pure: no I/O.
"""

from __future__ import annotations

DEFAULT_BYTES_PER_TOKEN = 3.0


class TokenEstimate:
    """Bytes per token per model: the lowest the workers have shown, at most the default."""

    def __init__(self, default: float = DEFAULT_BYTES_PER_TOKEN) -> None:
        self._default = default
        self._ratio: dict[str, float] = {}

    def bytes_per_token(self, model: str) -> float:
        return self._ratio.get(model, self._default)

    def tokens(self, model: str, nbytes: int) -> int:
        """The estimated tokens of a prompt of ``nbytes`` bytes (its request body)."""
        return int(nbytes / self.bytes_per_token(model))

    def learn(self, model: str, nbytes: int, tokens: int) -> None:
        """A request body of ``nbytes`` bytes held ``tokens`` prompt tokens (or more)."""
        if tokens <= 0 or nbytes <= 0:
            return
        ratio = max(1.0, nbytes / tokens)
        if ratio < self.bytes_per_token(model):
            self._ratio[model] = ratio
