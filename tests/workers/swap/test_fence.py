"""A swap group's fence (``group.fence``: this gateway's Redis claim is fresh, swap_lease.py)
is read again before a switch wakes its target: a switch takes as long as the holder's
requests take to end (``pause_after_s``, a minute by default) and its /sleep, well past the
claim's TTL, and another replica may control the group by the time the GPU is free."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from gpupool.workers.registry import Registry, Worker, WorkerState
from gpupool.workers.swap.demand import Demand
from gpupool.workers.swap.group import SwapGroup
from gpupool.workers.swap.member import GroupSeams, Member
from gpupool.workers.swap.policy import Turns


class _Events:
    def switched(self, group: str, model: str, seconds: float, waited: int) -> None:
        pass

    def paused(self, group: str, model: str, requests: int) -> None:
        pass


class _Fake:
    """A ``url:`` worker's sleep-mode endpoints; ``on_sleep`` runs when its /sleep is asked."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.on_sleep = lambda: None
        self.url = ""

    async def post(self, request: web.Request) -> web.Response:
        self.calls.append(request.path)
        if request.path == "/sleep":
            self.on_sleep()
        return web.json_response({})


@pytest.fixture
async def fakes() -> AsyncIterator[tuple[_Fake, _Fake]]:
    pair, runners = (_Fake(), _Fake()), []
    for fake in pair:
        app = web.Application()
        app.router.add_post("/{tail:.*}", fake.post)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        fake.url = f"http://127.0.0.1:{port}"
        runners.append(runner)
    yield pair
    for runner in runners:
        await runner.cleanup()


async def test_a_switch_whose_claim_went_stale_meanwhile_wakes_nothing(
    fakes: tuple[_Fake, _Fake],
) -> None:
    old_fake, new_fake = fakes
    registry = Registry()
    old = Worker("old", "coder", url=old_fake.url, state=WorkerState.ready, swap_group="g")
    new = Worker("new", "chat", url=new_fake.url, state=WorkerState.asleep, swap_group="g")
    registry.add(old)
    registry.add(new)
    fresh = [True]
    old_fake.on_sleep = lambda: fresh.__setitem__(0, False)  # the claim lapses meanwhile
    async with aiohttp.ClientSession() as session:
        seams = GroupSeams(registry, session, Demand(), _Events(), None, Turns(), 5.0, 5.0)
        members = [Member(old, 1, None, False), Member(new, 1, None, False)]
        group = SwapGroup("g", members, seams)
        group.holder = members[0]
        group.fence = lambda: fresh[0]
        assert not await group.switch_to(members[1])
    assert old_fake.calls == ["/sleep"] and new_fake.calls == []
    assert (old.state, new.state, group.holder) == (WorkerState.asleep, WorkerState.asleep, None)


async def test_a_fenced_group_switches_nothing_when_asked_directly(
    fakes: tuple[_Fake, _Fake],
) -> None:
    """An admin wake (``SwapController.wake``) switches outside the group's loop: on a replica
    whose claim is stale or taken (``lost_group``), it neither sleeps the holder nor wakes the
    target (the other replica controls them); nor does an admin sleep."""
    old_fake, new_fake = fakes
    registry = Registry()
    old = Worker("old", "coder", url=old_fake.url, state=WorkerState.ready, swap_group="g")
    new = Worker("new", "chat", url=new_fake.url, state=WorkerState.asleep, swap_group="g")
    registry.add(old)
    registry.add(new)
    async with aiohttp.ClientSession() as session:
        seams = GroupSeams(registry, session, Demand(), _Events(), None, Turns(), 5.0, 5.0)
        members = [Member(old, 1, None, False), Member(new, 1, None, False)]
        group = SwapGroup("g", members, seams)
        group.holder = members[0]
        group.fence = lambda: False
        assert not await group.switch_to(members[1])
        assert not await group.put_to_sleep(members[0])  # (an admin sleep)
        group.holder = None  # the GPU free as far as this replica knows
        assert not await group.switch_to(members[1])
    assert old_fake.calls == [] and new_fake.calls == []
    assert (old.state, new.state) == (WorkerState.ready, WorkerState.asleep)
