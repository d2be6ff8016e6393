"""Whose turn it is on a swap group's GPU. Pure: the holder and the waiting requests in, a model
(or nothing) out.

- Nobody holds the GPU: the most urgent waiting model gets it.
- The holder is idle (nothing running, nothing waiting for it): it gives way at once.
- Otherwise the holder keeps the GPU for ``min_awake_s`` (no thrash: a switch costs seconds),
  and after that for as long as its own waiting requests are more urgent than any other
  model's. Everything waiting for the model woken is admitted together (its batch), and what
  comes for the model put to sleep waits for its next turn.

Urgency is the oldest waiting request's age less ``priority_weight_s`` per priority point
(lower values first, as vLLM's priority scheduling), so a model's turn comes however busy the
other is: fairness by waiting time and priority.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gpupool.workers.swap.demand import ModelDemand


@dataclass(frozen=True, slots=True)
class Holder:
    model: str
    awake_s: float  # since it was woken (or became ready)
    busy: bool  # requests running on it


@dataclass(frozen=True, slots=True)
class Turns:
    min_awake_s: float = 10.0
    priority_weight_s: float = 10.0


def urgency(demand: ModelDemand, turns: Turns) -> float:
    return demand.oldest_s - turns.priority_weight_s * demand.best_priority


def next_model(
    holder: Holder | None, demand: Mapping[str, ModelDemand], turns: Turns
) -> str | None:
    """The model to switch the GPU to now, or None to leave it as it is."""
    others = {m: d for m, d in demand.items() if d.count and (holder is None or m != holder.model)}
    if not others:
        return None
    best = max(sorted(others), key=lambda m: urgency(others[m], turns))
    if holder is None:
        return best
    mine = demand.get(holder.model)
    if mine is not None and not mine.count:
        mine = None
    if not holder.busy and mine is None:
        return best
    if holder.awake_s < turns.min_awake_s:
        return None
    if mine is not None and urgency(mine, turns) >= urgency(others[best], turns):
        return None
    return best
