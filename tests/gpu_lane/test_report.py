"""scripts/gpu_lane/report.py: a lane result names the gpupool commit it measured (issue 25).

The H200 gets the working tree without ``.git``, so the check records a fingerprint of the
gpupool package it ran and the report finds the commit with the same files here."""

from __future__ import annotations

import subprocess
import sys
import tarfile
from io import BytesIO
from pathlib import Path

import pytest

from tests.support.procs import ROOT

sys.path.insert(0, str(ROOT / "scripts" / "gpu_lane"))
import report


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                          check=True, timeout=30).stdout.strip()  # fmt: skip


def export(commit: str, dest: Path) -> Path:
    """gpupool/ as committed in ``commit``, the way a wheel would carry it (no .git)."""
    data = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "gpupool"],
                          capture_output=True, check=True, timeout=60).stdout  # fmt: skip
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(dest, filter="data")
    return dest / "gpupool"


def test_a_committed_tree_is_found_by_its_files(tmp_path: Path) -> None:
    head = git("rev-parse", "HEAD")
    identity = report.tree_identity(export(head, tmp_path))
    assert "commit" not in identity  # no git beside an installed package
    assert report.resolve_commit(identity) == (head, True)


def test_a_changed_tree_is_called_uncommitted(tmp_path: Path) -> None:
    package = export(git("rev-parse", "HEAD"), tmp_path)
    (package / "cli" / "main.py").write_text("# changed on the way to the GPU\n")
    assert report.resolve_commit(report.tree_identity(package)) == (None, False)


def test_a_row_older_than_routing_says_so() -> None:
    changed = git("log", "-1", "--format=%H", "--", *report.ROUTING_PATHS)
    if not changed:
        pytest.skip("no routing change in this history")
    before = git("rev-parse", f"{changed}~1")
    cell = report.commit_cell({"meta": {"commit": before, "clean": True}})
    assert cell.startswith(before[:8]) and "older than routing/admission" in cell
    assert "older" not in report.commit_cell({"meta": {"commit": changed, "clean": True}})
    assert report.commit_cell({"meta": {}}) == "not recorded"
    assert report.commit_cell({"meta": {"commit": changed, "clean": False}}).endswith("+ changes")


def test_the_sleep_phases_show_their_switches_canary_and_pause() -> None:
    r = {
        "switch_l2": {
            "switch_ttft": {"n": 3, "p50": 9.5},
            "restarts_instead": 0,
            "failures": 0,
            "canary": {"runs": 3, "same_after_wake": 3, "same_as_first": 3},
            "runs": [{}, {}, {}],
        },
        "pause": {
            "paused_requests": 1.0,
            "stream": {"longest_gap_s": 31.2, "completion_tokens": 3000},
            "stream_whole": True,
            "same_text_as_unpaused": False,
        },
    }
    cell = report.swap_cell(r)
    assert "L2 switch p50 9.5 s (0 restarts instead, 0 failed), canary same 3/3" in cell
    assert "pause: 1 paused, stall 31.2 s, 3000 tokens whole, text differs" in cell
    assert report.swap_cell({}) == "-"
    old = {"switch_l2": {"switch_ttft": {"n": 3, "p50": 52.3}, "failures": 0, "runs": [{}]}}
    assert report.swap_cell(old) == "L2 not measured (its wakes were restarts)"


def test_a_planner_shapes_row_names_its_card() -> None:
    assert report.gpu_name({"meta": {"gpu": "NVIDIA H100 80GB HBM3, 81559 MiB"}}) == (
        "NVIDIA H100 80GB HBM3"
    )


def test_a_kill_with_migration_shows_the_next_token_gap() -> None:
    r = {
        "kill": {
            "recovered": True,
            "ready_again_after_s": 60.1,
            "client_outcomes": {"complete": 96},
            "client_errors": 0,
            "migrated_streams": 40.0,
            "next_token_gap_ms": {"n": 40, "p50": 812.0, "max": 1500.2},
        }
    }
    assert report.kill_cell(r) == (
        "back in 60.1 s, 0 error events, 0 client errors, 40.0 migrated, next token p50 812.0 ms "
        "(max 1500.2, 40 streams)"
    )
