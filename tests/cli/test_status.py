"""``gpupool status`` (cli/status.py): the default table fits 80 columns with the swap group and
time asleep; ``--wide`` has every column; swap groups show holder, waiting, switches."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from gpupool.cli.status import groups_table, workers_table


def worker(name: str, state: str, **extra: Any) -> dict[str, Any]:
    base = {"name": name, "model": "qwen3-coder-30b-a3b-instruct", "state": state,
            "gpus": [0], "max_model_len": 32768, "inflight": 3, "capacity": 256,
            "requests_total": 123456, "restarts": 2, "uptime_s": 5400.0, "asleep_s": 930.0,
            "swap_group": "gpu0", "last_error": None,
            "vllm": {"kv_cache_usage": 0.42, "waiting": 7}}  # fmt: skip
    return {**base, **extra}


WORKERS = [
    worker("coder-rtx-pro-6000", "ready"),
    worker("chat-rtx-pro-6000", "asleep", last_error="a very long error " * 8),
    worker("vision", "falling_asleep", swap_group=None),
]
GROUPS = [{"name": "gpu0", "holder": "coder-rtx-pro-6000", "waiting": {"chat": 3, "coder": 0},
           "switches": 17, "last_switch_at": 1000.0, "last_switch_s": 1.23}]  # fmt: skip


def render(table: Any, width: int) -> list[str]:
    console = Console(width=width, record=True, color_system=None)
    console.print(table)
    return console.export_text().splitlines()


def test_the_default_table_fits_80_columns_with_group_and_asleep_for() -> None:
    lines = render(workers_table(WORKERS), 80)
    assert max(len(line) for line in lines) <= 80
    head = next(line for line in lines if line.lstrip().startswith("worker"))
    for col in ("worker", "model", "state", "group", "load", "up/zz", "last"):
        assert col in head, head
    body = "\n".join(lines)
    assert "gpu0" in body and "z16m" in body  # asleep for 930 s in all
    assert "sleeping" in body  # falling_asleep, short
    assert "kv" not in head and "restarts" not in head


def test_wide_has_every_column() -> None:
    lines = render(workers_table(WORKERS, wide=True), 200)
    head = next(line for line in lines if line.lstrip().startswith("worker"))
    for col in ("gpus", "window", "requests", "restarts", "kv", "waiting"):
        assert col in head, head
    assert "123456" in "\n".join(lines)


def test_swap_groups_show_holder_waiting_and_switches_in_80_columns() -> None:
    lines = render(groups_table(GROUPS, now=1075.0), 80)
    assert max(len(line) for line in lines) <= 80
    body = "\n".join(lines)
    assert "coder-rtx-pro-6000" in body and "chat:3" in body and "17" in body
    assert "75s ago, 1.2s" in body
    free = render(groups_table([{**GROUPS[0], "holder": None, "last_switch_at": None}], 0), 80)
    assert "GPU free" in "\n".join(free)
