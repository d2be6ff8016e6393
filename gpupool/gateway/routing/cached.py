"""What precise prefix routing knows of one request (plain data, read by the pure policy)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True, frozen=True, eq=False)
class KvPrediction:
    """Per worker whose cache is known exactly: the prompt tokens vLLM will find cached there
    (``cached``) and the request's block hashes as that worker names them (``hashes``, so a
    placement can count them at once). Workers not named route on today's affinity."""

    tokens: int  # the prompt's tokens, as computed
    cached: dict[str, int] = field(default_factory=dict)
    hashes: dict[str, list[int]] = field(default_factory=dict)
    # of ``cached``, the tokens of blocks only placed there (a request just before, not yet
    # stored): what a miss is read against (``kvroute.predict.observe``)
    placed: dict[str, int] = field(default_factory=dict)
