"""Sleeping workers and routing: never a candidate to send to, always a place to wait.

A worker of a swap group that is asleep, waking or falling asleep gets no request (admission
grants slots only on ready workers), but a request for its model must wait in the model's queue
for it rather than fail: its wait is what tells the swap group to wake it (``workers/swap``).
So the sleeping workers that could serve a request go at the end of its candidates, after the
awake ones routing ranked; when the model has no awake worker they are all there is.
"""

from __future__ import annotations

from gpupool.gateway.routing.policy import RouteRequest, fits
from gpupool.workers.registry import SLEEP_STATES, Worker


def sleeping(workers: list[Worker]) -> list[Worker]:
    """The workers a request may wait for while they sleep."""
    return [w for w in workers if w.state in SLEEP_STATES]


def wait_for(route: RouteRequest, asleep: list[Worker]) -> list[Worker]:
    """Of ``asleep``, those whose window and media limits admit ``route``."""
    return [
        w
        for w in asleep
        if (w.window is None or fits(w, route))
        and w.media.admits(route.image, route.video, route.audio)
    ]
