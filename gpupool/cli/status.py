"""``gpupool status``: the admin worker list as a table, and each swap group's turn.

By default the columns fit an 80-column terminal (worker, model, state, swap group, load,
uptime or time asleep, last error); ``--wide`` adds GPUs, window, requests, restarts and vLLM's
KV cache and queue. Swap groups get a table of their own: who holds the GPU, what waits per
model, how many switches and the last one.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import orjson
from rich import box
from rich.console import Console
from rich.table import Table

_STATE_STYLE = {"ready": "green", "failed": "red", "draining": "yellow", "stopped": "dim",
                "asleep": "blue", "waking": "magenta", "falling_asleep": "magenta"}  # fmt: skip
_SHORT_STATE = {"falling_asleep": "sleeping"}  # (the widest state: 8 columns, not 14)


def run_status(url: str, admin_key: str | None, as_json: bool, wide: bool = False) -> int:
    headers = {"authorization": f"Bearer {admin_key}"} if admin_key else {}
    console = Console()
    try:
        r = httpx.get(f"{url.rstrip('/')}/admin/workers", headers=headers, timeout=10)
    except httpx.HTTPError as e:
        console.print(f"[red]cannot reach {url}: {e}[/red]")
        return 1
    if r.status_code != 200:
        console.print(f"[red]{url} answered {r.status_code}: {r.text[:300]}[/red]")
        return 1
    reply = r.json()
    data: list[dict[str, Any]] = reply["data"]
    if as_json:
        print(orjson.dumps(data, option=orjson.OPT_INDENT_2).decode())
        return 0
    console.print(workers_table(data, wide, console.width))
    groups: list[dict[str, Any]] = reply.get("groups") or []
    if groups:
        console.print(groups_table(groups, time.time()))
    return 0


def _ago(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.0f}h"


def _since(w: dict[str, Any]) -> str:
    """Uptime, or for a sleeping member how long it has slept in all (``z`` marks it)."""
    if w["state"] == "asleep" and w.get("asleep_s") is not None:
        return f"z{_ago(w['asleep_s'])}"
    return _ago(w["uptime_s"]) if w["uptime_s"] is not None else "-"


# the default table's columns and their widths (the last error gets what is left of 80)
_NARROW = (("worker", 14), ("model", 12), ("state", 9), ("group", 6), ("load", 7), ("up/zz", 5))


def workers_table(workers: list[dict[str, Any]], wide: bool = False, width: int = 80) -> Table:
    t = Table(title="gpupool workers", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col, size in _NARROW:
        t.add_column(col, no_wrap=True, overflow="ellipsis", width=None if wide else size)
    extra = ("gpus", "window", "requests", "restarts", "kv", "waiting") if wide else ()
    for col in extra:
        t.add_column(col, no_wrap=True)
    used = sum(size for _, size in _NARROW) + 2 * len(_NARROW) + 3  # (padding, and slack)
    t.add_column("last error", overflow="fold" if wide else "ellipsis", no_wrap=not wide,
                 width=None if wide else max(10, width - used))  # fmt: skip
    for w in workers:
        style = _STATE_STYLE.get(w["state"], "cyan")
        state = _SHORT_STATE.get(w["state"], w["state"])
        vllm = w.get("vllm") or {}
        cells = [
            w["name"], w["model"], f"[{style}]{state}[/{style}]", w.get("swap_group") or "-",
            f"{w['inflight']}/{w['capacity']}", _since(w),
        ]  # fmt: skip
        if wide:
            cells += [
                ",".join(map(str, w["gpus"] or [])) or "-", str(w["max_model_len"] or "-"),
                str(w["requests_total"]), str(w["restarts"]),
                f"{vllm.get('kv_cache_usage', 0):.0%}", str(int(vllm.get("waiting", 0))),
            ]  # fmt: skip
        t.add_row(*cells, w["last_error"] or "")
    return t


def groups_table(groups: list[dict[str, Any]], now: float) -> Table:
    t = Table(title="swap groups", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("group", "holder", "waiting", "switches", "last switch"):
        t.add_column(col, overflow="fold")
    for g in groups:
        waiting = " ".join(f"{m}:{n}" for m, n in sorted(g["waiting"].items())) or "-"
        last = "-"
        if g.get("last_switch_at") is not None:
            last = f"{_ago(max(0.0, now - g['last_switch_at']))} ago, {g['last_switch_s']:.1f}s"
        holder = g["holder"] or "none (GPU free)"
        t.add_row(g["name"], holder, waiting, str(g["switches"]), last)
    return t
