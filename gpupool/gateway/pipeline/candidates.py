"""The workers that may serve a request, best first, or the error that says why none may.

Routing's policy (``gateway/routing/policy.py``) ranks; this reads the registry and turns an
empty answer into the client's error: no live worker (503), media no worker admits (400), a
prompt no window holds (vLLM's context-length 400).
"""

from __future__ import annotations

from gpupool.gateway.errors import ContextLengthExceeded, MediaRejected, UpstreamUnavailable
from gpupool.gateway.routing.asleep import sleeping, wait_for
from gpupool.gateway.routing.policy import Decision, Router, RouteRequest
from gpupool.workers.registry import Registry, Worker, WorkerState

_LIVE = (WorkerState.starting, WorkerState.warming, WorkerState.ready)


class Candidates:
    def __init__(self, registry: Registry, router: Router) -> None:
        self.registry = registry
        self.router = router

    def of(self, route: RouteRequest, model: str) -> list[Worker]:
        return self.decide(route, model).candidates

    def decide(self, route: RouteRequest, model: str) -> Decision:
        """Routing's decision, with at least one candidate."""
        workers = self.registry.of_model(model)
        live = [w for w in workers if w.state in _LIVE]
        asleep = sleeping(workers)
        if not live and not asleep:
            raise UpstreamUnavailable(f"No worker for model `{model}` is available.")
        decision = self.router.decide(route, live or asleep)
        if decision.candidates:
            if live and asleep:  # wait for a sleeping one too (its wait may wake it)
                decision.candidates += wait_for(route, asleep)
            return decision
        if decision.media_refused:
            raise MediaRejected(
                f"No worker of model `{model}` accepts {route.image} image(s), "
                f"{route.video} video(s) and {route.audio} audio item(s) in one prompt.",
                param="messages",
            )
        window = decision.too_long_for or 0
        raise ContextLengthExceeded(window, min(route.prompt_tokens, window + 1))
