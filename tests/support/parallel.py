"""How ``make test`` spreads the suite over pytest-xdist workers (``-n N``), correctly on 2 cores.

A pytest plugin (loaded by ``tests/conftest.py``); it changes nothing without ``-n``.

* **A test file is one unit of work**, run whole on one worker in its own order, so a module's
  fixtures (a gateway, a Redis, a browser) start once, as they do without xdist.
* **Heavy files share one unit** (:data:`HEAVY`): the real-vLLM suite (its session fixture
  starts two vLLM CPU workers, which must start once and never beside a second pair) and
  the Docker stack (a private dockerd building images) would each take both cores; in one unit
  they run one after the other on one worker while the other workers run the light files.
* **Longest first.** Each time a worker asks for work it gets the unit expected to take the
  longest (:data:`DURATIONS`, seconds per file measured by ``--timing-json``; a file not in it
  counts :data:`NEW_FILE_S` per test), so no long file starts last and leaves the others idle.

Ports come from ``tests/support/procs.free_port`` (one lock file for every test process on the
machine), state from ``tmp_path``: nothing else is shared between workers.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

# Files whose tests each need most of the machine: one unit, so one worker, one at a time.
HEAVY = ("tests/vllm/", "tests/deploy/test_stack.py")
HEAVY_UNIT = "heavy: real vLLM and Docker"
DURATIONS = Path(__file__).with_name("durations.json")
NEW_FILE_S = 1.0


# What `make check` leaves out, marked here whatever the file says: every test under tests/vllm/
# needs real vLLM; a module that imports the Docker engine's or the browser's helpers needs those.
MARK_BY_PATH = {"tests/vllm/": "vllm"}
MARK_BY_HELPER = {"tests.deploy.docker_env": "docker", "tests.gateway.ui.browser": "browser"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        kinds = {kind for path, kind in MARK_BY_PATH.items() if item.nodeid.startswith(path)}
        module = getattr(item, "module", None)
        for value in vars(module).values() if module is not None else ():
            kinds.add(MARK_BY_HELPER.get(getattr(value, "__module__", ""), ""))
        for kind in sorted(kinds - {""}):
            item.add_marker(kind)


def unit_of(nodeid: str) -> str:
    """The unit of work ``nodeid`` belongs to: its file, or :data:`HEAVY_UNIT`."""
    path = nodeid.split("::", 1)[0]
    return HEAVY_UNIT if path.startswith(HEAVY) else path


def expected_seconds(nodeids: list[str], measured: dict[str, float]) -> dict[str, float]:
    """Each unit's expected seconds: measured per file, else :data:`NEW_FILE_S` per test."""
    files = Counter(nodeid.split("::", 1)[0] for nodeid in nodeids)
    cost: Counter[str] = Counter()
    for path, count in files.items():
        cost[unit_of(path)] += measured.get(path, NEW_FILE_S * count)
    return dict(cost)


def _measured() -> dict[str, float]:
    try:
        data: dict[str, float] = json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        return {}
    return data


def _scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class LongestFileFirst(LoadScopeScheduling):
        """xdist's scope scheduling with :func:`unit_of` as the scope, longest unit first."""

        cost: dict[str, float] | None = None

        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

        def _assign_work_unit(self, node: Any) -> None:
            if self.cost is None:
                self.cost = expected_seconds(list(self.collection or ()), _measured())
            cost = self.cost  # the heavy unit first whatever its estimate: it is the longest
            longest = max(self.workqueue, key=lambda u: (u == HEAVY_UNIT, cost.get(u, 0.0)))
            self.workqueue.move_to_end(longest, last=False)
            super()._assign_work_unit(node)

    return LongestFileFirst(config, log)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    return _scheduler(config, log)


def write_durations(timing_json: Path, out: Path = DURATIONS) -> dict[str, float]:
    """Seconds per file from a ``--timing-json`` file, as :data:`DURATIONS` keeps them."""
    tests: dict[str, float] = json.loads(timing_json.read_text())["tests"]
    per: Counter[str] = Counter()
    for nodeid, seconds in tests.items():
        per[nodeid.split("::", 1)[0]] += seconds
    kept = {path: round(max(s, 0.1), 1) for path, s in sorted(per.items())}
    out.write_text(json.dumps(kept, indent=1) + "\n")
    return kept


if __name__ == "__main__":  # python -m tests.support.parallel TIMING_JSON
    import sys

    write_durations(Path(sys.argv[1]))
