"""Whose turn it is on a swap group's GPU. Pure: the holder, the waiting requests and the
measured switch time in, a model (or nothing) out. Policies register by name (``POLICIES``);
``swap.policy`` picks one, an unknown name fails at config load.

``weighed`` (the default) weighs the switch:

- Nobody holds the GPU: the most urgent waiting model gets it.
- The holder is idle (nothing running, nothing queued for it): it gives way (nobody pays for
  the switch), but not within one switch time of its last request while what waits elsewhere
  is younger than a switch: an agent between two calls to one model (a tool call) comes back
  sooner than a switch away and back would take. Anticipation, as disk schedulers do it.
- A model whose oldest request would wait past ``max_wait_s`` gets the GPU now, whatever else
  holds: the bound that keeps any model from starving. The switch starts twice its measured
  time before the bound (a switch's drain varies with what runs on the holder).
- Otherwise the holder keeps the GPU for ``min_awake_s`` (a model mid-job is not swapped out),
  and after that until the waiting demand outweighs what the switch costs the holder:

      demand = Σ over the other model's waiting requests of (age + priority_weight_s * -priority)
      cost   = (holder's running + queued requests) * 2 * switch_s / max_switch_share

  in request-seconds: each active request of the holder loses a round trip (away and back,
  ``switch_s`` being the group's measured switch, its drain included), and a switch is worth it
  only when it buys back ``1 / max_switch_share`` times that in waiting. Meanwhile what arrives
  for the sleeping model waits and is admitted together at its wake: one switch for a batch.

``turns`` (gpupool's first policy, kept for comparison): the holder keeps the GPU for
``min_awake_s``, then for as long as its own oldest waiting request is more urgent than any
other model's; an idle holder gives way at once. It switches for a single request, however
busy the holder.

Urgency is the oldest waiting request's age less ``priority_weight_s`` per priority point
(lower values first, as vLLM's priority scheduling).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from gpupool.workers.swap.demand import ModelDemand


@dataclass(frozen=True, slots=True)
class Holder:
    model: str
    awake_s: float  # since it was woken (or became ready)
    busy: bool  # requests running on it
    running: int = 0  # how many
    idle_s: float = float("inf")  # since its last request ended (0 while it has some)


@dataclass(frozen=True, slots=True)
class Turns:
    min_awake_s: float = 10.0
    priority_weight_s: float = 10.0
    policy: str = "turns"
    max_wait_s: float = 30.0
    max_switch_share: float = 0.1


Policy = Callable[[Holder | None, Mapping[str, ModelDemand], Turns, float], str | None]


def urgency(demand: ModelDemand, turns: Turns) -> float:
    return demand.oldest_s - turns.priority_weight_s * demand.best_priority


def weight(demand: ModelDemand, turns: Turns) -> float:
    """A model's waiting, in request-seconds, a priority point counting as its weight."""
    return demand.total_age_s - turns.priority_weight_s * demand.best_priority * demand.count


def _others(holder: Holder | None, demand: Mapping[str, ModelDemand]) -> dict[str, ModelDemand]:
    return {m: d for m, d in demand.items() if d.count and (holder is None or m != holder.model)}


def _most_urgent(others: Mapping[str, ModelDemand], turns: Turns) -> str:
    return max(sorted(others), key=lambda m: urgency(others[m], turns))


def turns_policy(
    holder: Holder | None, demand: Mapping[str, ModelDemand], turns: Turns, switch_s: float
) -> str | None:
    others = _others(holder, demand)
    if not others:
        return None
    best = _most_urgent(others, turns)
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


def weighed(
    holder: Holder | None, demand: Mapping[str, ModelDemand], turns: Turns, switch_s: float
) -> str | None:
    others = _others(holder, demand)
    if not others:
        return None
    best = _most_urgent(others, turns)
    if holder is None:
        return best
    mine = demand.get(holder.model)
    active = holder.running + (mine.count if mine is not None else 0)
    if active == 0:
        soon = holder.idle_s < switch_s and others[best].oldest_s < switch_s
        return None if soon else best
    overdue = {m: d for m, d in others.items() if d.oldest_s + 2 * switch_s >= turns.max_wait_s}
    if overdue:
        return _most_urgent(overdue, turns)
    if holder.awake_s < turns.min_awake_s:
        return None
    cost = active * 2 * switch_s / max(turns.max_switch_share, 1e-6)
    return best if weight(others[best], turns) >= cost else None


POLICIES: dict[str, Policy] = {"weighed": weighed, "turns": turns_policy}


def next_model(
    holder: Holder | None,
    demand: Mapping[str, ModelDemand],
    turns: Turns,
    switch_s: float = 2.0,
) -> str | None:
    """The model to switch the GPU to now, or None to leave it as it is."""
    return POLICIES[turns.policy](holder, demand, turns, switch_s)
