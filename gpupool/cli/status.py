"""``gpupool status``: the admin worker list as a table."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
from rich.console import Console
from rich.table import Table

_STATE_STYLE = {"ready": "green", "failed": "red", "draining": "yellow", "stopped": "dim",
                "asleep": "blue", "waking": "magenta", "falling_asleep": "magenta"}  # fmt: skip


def run_status(url: str, admin_key: str | None, as_json: bool) -> int:
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
    data: list[dict[str, Any]] = r.json()["data"]
    if as_json:
        print(orjson.dumps(data, option=orjson.OPT_INDENT_2).decode())
        return 0
    console.print(_table(data))
    return 0


def _table(workers: list[dict[str, Any]]) -> Table:
    t = Table(title="gpupool workers")
    for col in ("worker", "model", "state", "gpus", "window", "inflight", "requests",
                "restarts", "kv", "waiting", "uptime", "last error"):  # fmt: skip
        t.add_column(col)
    for w in workers:
        style = _STATE_STYLE.get(w["state"], "cyan")
        vllm = w.get("vllm") or {}
        t.add_row(
            w["name"], w["model"], f"[{style}]{w['state']}[/{style}]",
            ",".join(map(str, w["gpus"] or [])) or "-", str(w["max_model_len"] or "-"),
            f"{w['inflight']}/{w['capacity']}", str(w["requests_total"]), str(w["restarts"]),
            f"{vllm.get('kv_cache_usage', 0):.0%}", str(int(vllm.get("waiting", 0))),
            f"{w['uptime_s']:.0f}s" if w["uptime_s"] is not None else "-",
            (w["last_error"] or "")[:60],
        )  # fmt: skip
    return t
