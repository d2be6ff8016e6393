"""Where the suite's time goes: the slowest tests and the time per test folder.

A pytest plugin (loaded by ``tests/conftest.py``). ``--timing=N`` ends the run with two tables:
the N slowest tests (setup + call + teardown, so a session fixture's start is charged to the
first test that needs it) and the time per folder of ``tests/`` with its number of tests.
``--timing-json=PATH`` writes every test's time, for comparing two runs, and its CPU seconds
(``cpu``: the test process's and the children it reaped, between this report and the last one in
that process, so a module fixture's servers count where they stop): on 2 cores the CPU, not the
wall, bounds how far more workers help.

Under pytest-xdist the reports reach the controller, so the tables cover every worker; the
folder times then add up to more than the wall time (workers run side by side), and the
summary line says both.
"""

from __future__ import annotations

import json
import resource
import time
from collections import defaultdict
from pathlib import Path

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("timing", "where the suite's time goes (tests/support/timing.py)")
    group.addoption("--timing", type=int, default=0, metavar="N",
                    help="print the N slowest tests and the time per test folder")  # fmt: skip
    group.addoption("--timing-json", default=None, metavar="PATH",
                    help="write every test's seconds (setup+call+teardown) as JSON")  # fmt: skip


class Timing:
    """Sums each test's phases as their reports arrive (from xdist workers too)."""

    def __init__(self, top: int, json_path: str | None) -> None:
        self.top, self.json_path = top, json_path
        self.seconds: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.worker: dict[str, str] = {}
        self.started = time.monotonic()

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] += report.duration
        for name, value in report.user_properties:
            if name == CPU_PROPERTY:
                self.cpu[report.nodeid] += float(value)
        node = getattr(report, "node", None)  # xdist: the worker that ran it
        if node is not None:
            self.worker[report.nodeid] = str(node.gateway.id)

    @pytest.hookimpl(trylast=True)
    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        wall = time.monotonic() - self.started
        if self.json_path:
            out = {"wall_s": round(wall, 1), "tests": dict(self.seconds), "worker": self.worker,
                   "cpu": {k: round(v, 2) for k, v in self.cpu.items()}}  # fmt: skip
            Path(self.json_path).write_text(json.dumps(out, indent=1, sort_keys=True))
        if self.top and self.seconds:
            self._report(terminalreporter, wall)

    def _report(self, tr: pytest.TerminalReporter, wall: float) -> None:
        tr.write_sep("=", f"{self.top} slowest tests (setup + call + teardown)")
        ranked = sorted(self.seconds.items(), key=lambda kv: -kv[1])
        for nodeid, s in ranked[: self.top]:
            tr.write_line(f"{s:8.1f}s  {nodeid}")
        tr.write_sep("=", "time per test folder")
        for folder, (s, n) in folder_times(self.seconds).items():
            tr.write_line(f"{s:8.1f}s  {n:5d} tests  {folder}")
        total = sum(self.seconds.values())
        workers = len(set(self.worker.values())) or 1
        tr.write_line(
            f"{len(self.seconds)} tests, {total:.0f}s of test time on {workers} worker(s), "
            f"{sum(self.cpu.values()):.0f}s of CPU, {wall:.0f}s wall"
        )


def folder_times(seconds: dict[str, float]) -> dict[str, tuple[float, int]]:
    """Seconds and test count per folder of the test files, slowest first."""
    per: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for nodeid, s in seconds.items():
        folder = nodeid.split("::", 1)[0].rpartition("/")[0] or "."
        per[folder][0] += s
        per[folder][1] += 1
    ordered = sorted(per.items(), key=lambda kv: -kv[1][0])
    return {folder: (s, int(n)) for folder, (s, n) in ordered}


def pytest_configure(config: pytest.Config) -> None:
    top, path = config.getoption("timing"), config.getoption("timing_json")
    if (top or path) and not hasattr(config, "workerinput"):  # the controller only
        config.pluginmanager.register(Timing(top, path), "gpupool-timing")


CPU_PROPERTY = "gpupool-cpu-s"


def _cpu_now() -> float:
    own, reaped = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime


_last_cpu = [_cpu_now()]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> object:
    """Put the CPU seconds since this process's last report on this one (every process: the
    controller reads it from an xdist worker's report)."""
    outcome = yield
    now = _cpu_now()
    report: pytest.TestReport = outcome.get_result()  # type: ignore[attr-defined]
    report.user_properties.append((CPU_PROPERTY, round(now - _last_cpu[0], 3)))
    _last_cpu[0] = now
