"""Worker metrics reach a real Prometheus, and every dashboard query and alert rule works on it.

The stack is the seed-000 layout in miniature: `gpupool serve` (a real process) launches and
supervises two `gpupool sim` workers pinned to GPUs 0 and 1 and keeps the Prometheus SD file
current; a real `prometheus` (Debian's package, see scripts/install_ops_deps.sh) scrapes the
gateway and, through that file, the workers, with the committed docker/prometheus/prometheus.yml
and alerts.yml (only addresses, paths and intervals changed). Then every panel query of the
committed Grafana dashboard and every alert expression is evaluated through Prometheus' HTTP API.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import yaml

from gpupool.ops import sd_file_path, sd_targets, write_sd_file
from gpupool.workers.registry import Worker, WorkerState
from tests.support.procs import ROOT, Proc, free_port, gateway, running

MODEL = "qwen3.5-35b-a3b"
DOCKER = ROOT / "docker"
PROM_CONFIG = DOCKER / "prometheus" / "prometheus.yml"
ALERTS = DOCKER / "prometheus" / "alerts.yml"
DASHBOARDS = DOCKER / "grafana" / "dashboards"
REQUESTS = 36
T = TypeVar("T")

# Panels that are empty on a healthy pool under this load; every other panel must have data.
MAY_BE_EMPTY = {"Restarts", "Errors/s by cause", "Upstream retries/s"}
# This stack has no swap group (sleep mode): tests/gateway/swap/ checks those metrics.
MAY_BE_EMPTY |= {"Switches", "Switch time", "Asleep and waiting for a switch"}
# Panels whose metrics are set at scrape time (checked by test_gateway_exports_scrape_time_gauges).
SCRAPE_TIME = {"Queue depth": "gpupool_queue_depth"}


# --- the SD file, as a pure function and as a file ------------------------------------------


def _worker(name: str, state: WorkerState = WorkerState.ready, **kw: Any) -> Worker:
    kw.setdefault("url", f"http://127.0.0.1:{8000 + len(name)}")
    return Worker(name=name, model=MODEL, state=state, **kw)


def test_sd_targets_lists_ready_workers_with_labels() -> None:
    workers = [
        _worker("small", gpus=[1], url="http://127.0.0.1:8102"),
        _worker("big", gpus=[0], url="http://127.0.0.1:8101"),
        _worker("tp", gpus=[2, 3], url="http://127.0.0.1:8103/"),
        _worker("starting", WorkerState.starting, gpus=[4]),
        _worker("draining", WorkerState.draining),
        _worker("failed", WorkerState.failed),
        _worker("no-url", url=None),
    ]
    assert sd_targets(workers) == [
        {"targets": ["127.0.0.1:8101"], "labels": {"worker": "big", "model": MODEL, "gpus": "0"}},
        {"targets": ["127.0.0.1:8102"], "labels": {"worker": "small", "model": MODEL, "gpus": "1"}},
        {"targets": ["127.0.0.1:8103"], "labels": {"worker": "tp", "model": MODEL, "gpus": "2,3"}},
    ]


def test_sd_targets_remote_urls_keep_scheme_and_path() -> None:
    workers = [
        _worker("plain", url="http://vllm-big:8000"),
        _worker("tls", url="https://gpu-box.example/vllm"),
        _worker("v6", url="http://[::1]:9000"),
    ]
    by_name = {e["labels"]["worker"]: e for e in sd_targets(workers)}
    assert by_name["plain"] == {
        "targets": ["vllm-big:8000"],
        "labels": {"worker": "plain", "model": MODEL},
    }
    assert by_name["tls"]["targets"] == ["gpu-box.example:443"]
    assert by_name["tls"]["labels"]["__scheme__"] == "https"
    assert by_name["tls"]["labels"]["__metrics_path__"] == "/vllm/metrics"
    assert by_name["v6"]["targets"] == ["[::1]:9000"]


def test_write_sd_file_is_atomic_and_readable(tmp_path: Path) -> None:
    path = sd_file_path(tmp_path / "state")
    assert path == tmp_path / "state" / "prometheus" / "workers.json"
    write_sd_file(path, [_worker("big", gpus=[0])])
    first = json.loads(path.read_text())
    assert [e["labels"]["worker"] for e in first] == ["big"]
    assert path.stat().st_mode & 0o444 == 0o444  # Prometheus may run as another user
    write_sd_file(path, [_worker("big", WorkerState.failed, gpus=[0])])
    assert json.loads(path.read_text()) == []
    assert [p.name for p in path.parent.iterdir()] == ["workers.json"]  # no temporary left


# --- a real Prometheus --------------------------------------------------------------------


def _ensure_prometheus() -> None:
    if shutil.which("prometheus") and shutil.which("promtool"):
        return
    script = ROOT / "scripts" / "install_ops_deps.sh"
    r = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=600)
    if r.returncode != 0 or not (shutil.which("prometheus") and shutil.which("promtool")):
        pytest.skip(f"prometheus cannot be installed: {(r.stderr or r.stdout).strip()[-500:]}")


def _promtool(*args: str) -> str:
    r = subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"promtool {' '.join(args)}:\n{r.stdout}\n{r.stderr}"
    return r.stdout


def _sim_worker(name: str, gpu: int, seqs: int, itl_ms: int) -> dict[str, Any]:
    return {
        "name": name,
        "model": MODEL,
        "launch": {
            "gpus": [gpu],
            "model_path": "simulated",
            "command": ["{python}", "-m", "gpupool.workers.sim"],
            "args": {
                "max-model-len": 8192,
                "max-num-seqs": seqs,
                "ttft-ms": 40,
                "itl-ms": itl_ms,
                "mode": "lorem",
                "output-tokens": 12,
            },
            "startup_timeout_s": 60,
            "backoff_initial_s": 6,  # a killed worker stays down long enough to be seen
        },
    }


def _prometheus_config(gw: str, sd: Path) -> dict[str, Any]:
    """The committed prometheus.yml with this test's addresses, paths and 1 s intervals."""
    cfg: dict[str, Any] = yaml.safe_load(PROM_CONFIG.read_text())
    cfg["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    cfg["rule_files"] = [str(ALERTS)]
    jobs = {job["job_name"]: job for job in cfg["scrape_configs"]}
    assert set(jobs) == {"gpupool", "vllm"}
    jobs["gpupool"]["static_configs"] = [{"targets": [gw.removeprefix("http://")]}]
    (sd_config,) = jobs["vllm"]["file_sd_configs"]
    sd_config.update(files=[str(sd)], refresh_interval="1s")
    return cfg


def _wait(what: str, probe: Callable[[], T | None], timeout: float = 30.0) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.2)
    raise TimeoutError(f"timed out waiting for {what}")


def _workers(gw: str) -> dict[str, dict[str, Any]]:
    data = httpx.get(gw + "/admin/workers", timeout=5).json()["data"]
    return {w["name"]: w for w in data}


def _states(gw: str) -> dict[str, str]:
    return {name: w["state"] for name, w in _workers(gw).items()}


def _sd_entries(path: Path) -> dict[str, dict[str, Any]]:
    try:
        return {e["labels"]["worker"]: e for e in json.loads(path.read_text())}
    except (OSError, ValueError):
        return {}


class Prom:
    def __init__(self, url: str) -> None:
        self.url = url

    def query(self, expr: str) -> dict[str, Any]:
        r = httpx.get(self.url + "/api/v1/query", params={"query": expr}, timeout=10)
        body: dict[str, Any] = r.json()
        assert r.status_code == 200 and body["status"] == "success", f"{expr}\n{body}"
        return body

    def vector(self, expr: str) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.query(expr)["data"]["result"]
        return result

    def api(self, path: str) -> Any:
        return httpx.get(self.url + "/api/v1/" + path, timeout=10).json()["data"]


def _up(prom: Prom) -> int:
    return len(prom.vector('up{job=~"gpupool|vllm"} == 1'))


def _chat(gw: str, i: int) -> int:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"request {i}: tell me about GPUs"}],
        "max_tokens": 12,
    }
    if i % 2:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", gw + "/v1/chat/completions", json=body, timeout=60) as r:
            raw = b"".join(r.iter_raw())
            assert raw.rstrip().endswith(b"data: [DONE]"), raw[-300:]
            return r.status_code
    return httpx.post(gw + "/v1/chat/completions", json=body, timeout=60).status_code


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    _ensure_prometheus()
    tmp = tmp_path_factory.mktemp("ops")
    state = tmp / "state"
    cfg = {
        "server": {"host": "127.0.0.1", "state_dir": str(state)},
        "models": [{"name": MODEL, "aliases": ["qwen3.5"]}],
        "workers": [_sim_worker("big", 0, 4, 15), _sim_worker("small", 1, 2, 10)],
        "routing": {"health_interval_s": 0.3, "metrics_interval_s": 0.5},
        "queue": {"max_wait_s": 30},
    }
    gw = gateway(cfg, tmp)
    sd = sd_file_path(state)
    with running(gw, ready_path="/ready", timeout=60):
        _wait("both workers ready", lambda: _states(gw.url) == {"big": "ready", "small": "ready"})
        port = free_port()
        prom_cfg = tmp / "prometheus.yml"
        prom_cfg.write_text(yaml.safe_dump(_prometheus_config(gw.url, sd), sort_keys=False))
        prom = Proc(
            ["prometheus", f"--config.file={prom_cfg}", f"--storage.tsdb.path={tmp / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            f"http://127.0.0.1:{port}", tmp / "prometheus.log",
        )  # fmt: skip
        with running(prom, ready_path="/-/ready", timeout=60):
            api = Prom(prom.url)
            _wait("Prometheus scraping the gateway and both workers", lambda: _up(api) == 3)
            yield {"gw": gw, "prom": api, "sd": sd, "prom_cfg": prom_cfg, "tmp": tmp}


@pytest.fixture(scope="module")
def loaded(stack: dict[str, Any]) -> dict[str, Any]:
    """The stack after a few dozen chat requests, streaming and not, 12 at a time (more than
    the 6 slots, so some queue), once Prometheus has scraped the final counters."""
    prom: Prom = stack["prom"]
    with ThreadPoolExecutor(12) as pool:
        statuses = list(pool.map(lambda i: _chat(stack["gw"].url, i), range(REQUESTS)))
    assert statuses == [200] * REQUESTS

    def scraped() -> bool:
        total = prom.vector("sum(gpupool_requests_total)")
        return bool(total) and float(total[0]["value"][1]) >= REQUESTS

    _wait("Prometheus to scrape every request", scraped)
    seen = float(prom.vector("max(timestamp(gpupool_requests_total))")[0]["value"][1])

    def two_more_scrapes() -> bool:  # of every target (1-s interval), after the one that saw it
        latest = prom.vector('min(timestamp(up{job=~"gpupool|vllm"}))')
        return bool(latest) and float(latest[0]["value"][1]) >= seen + 2.0

    # every series has samples on both sides of the load: awaited, where a fixed 2.5 s was two
    # scrapes only on a machine whose Prometheus kept its pace
    _wait("two more scrapes of every target", two_more_scrapes)
    return stack


def test_promtool_accepts_rules_and_config(stack: dict[str, Any]) -> None:
    assert "SUCCESS" in _promtool("check", "rules", str(ALERTS))
    _promtool("check", "config", str(stack["prom_cfg"]))
    _promtool("check", "config", "--syntax-only", str(PROM_CONFIG))


def test_gateway_keeps_sd_file_and_prometheus_scrapes_workers(stack: dict[str, Any]) -> None:
    workers = _workers(stack["gw"].url)
    _wait("SD file with both workers", lambda: len(_sd_entries(stack["sd"])) == 2)
    entries = _sd_entries(stack["sd"])
    for name, gpu in (("big", "0"), ("small", "1")):
        port = workers[name]["url"].rsplit(":", 1)[1]
        assert entries[name] == {
            "targets": [f"127.0.0.1:{port}"],
            "labels": {"worker": name, "model": MODEL, "gpus": gpu},
        }
    targets = stack["prom"].api("targets?state=active")["activeTargets"]
    vllm = {t["labels"]["worker"]: t for t in targets if t["labels"]["job"] == "vllm"}
    assert set(vllm) == {"big", "small"}
    assert {t["labels"]["gpus"] for t in vllm.values()} == {"0", "1"}
    kv = stack["prom"].vector("vllm:kv_cache_usage_perc")
    assert {(s["metric"]["worker"], s["metric"]["gpus"]) for s in kv} == {
        ("big", "0"),
        ("small", "1"),
    }


_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")
_SUBSTITUTES = {"__rate_interval": "1m", "__interval": "5s", "__range": "5m"}


def _substitute(expr: str, variables: set[str]) -> str:
    def one(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name in _SUBSTITUTES:
            return _SUBSTITUTES[name]
        assert name in variables, f"unknown Grafana variable ${name} in {expr}"
        return ".*"  # every query variable is a multi-value regex whose All is .*

    return _VARIABLE.sub(one, expr)


def _panels() -> list[tuple[str, str, dict[str, Any]]]:
    """(dashboard file, panel title, panel) for every panel with queries, rows included."""
    out = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        board = json.loads(path.read_text())
        stack = list(board["panels"])
        while stack:
            panel = stack.pop(0)
            stack += panel.get("panels", [])
            if panel.get("targets"):
                out.append((path.name, panel["title"], panel))
    return out


def _variables() -> set[str]:
    names: set[str] = set()
    for path in DASHBOARDS.glob("*.json"):
        names |= {v["name"] for v in json.loads(path.read_text())["templating"]["list"]}
    return names


def test_every_dashboard_query_evaluates_and_has_data(loaded: dict[str, Any]) -> None:
    prom: Prom = loaded["prom"]
    panels = _panels()
    titles = {title for _, title, _ in panels}
    assert len(panels) >= 20 and titles >= MAY_BE_EMPTY
    variables, empty = _variables(), []
    for board, title, panel in panels:
        for target in panel["targets"]:
            expr = _substitute(target["expr"], variables)
            result = prom.vector(expr)  # asserts Prometheus accepted it
            if title not in MAY_BE_EMPTY and not result:
                empty.append(f"{board}: {title}: {expr}")
            if "gpus" in target["legendFormat"]:
                assert {s["metric"].get("gpus") for s in result} <= {"0", "1"}, (title, result)
    assert not empty, "panels without data:\n" + "\n".join(empty)


def test_gateway_exports_scrape_time_gauges(loaded: dict[str, Any]) -> None:
    missing = [m for m in SCRAPE_TIME.values() if not loaded["prom"].vector(m)]
    assert not missing, f"declared in gateway/metrics.py but never set: {missing}"


def test_every_query_variable_has_values(loaded: dict[str, Any]) -> None:
    expected = {"model": {MODEL}, "worker": {"big", "small"}, "gpu": {"0", "1"}}
    for path in DASHBOARDS.glob("*.json"):
        for var in json.loads(path.read_text())["templating"]["list"]:
            if var["type"] != "query":
                continue
            m = re.fullmatch(r"label_values\((.*), (\w+)\)", var["query"])
            assert m, var["query"]
            series = loaded["prom"].vector(_substitute(m.group(1), _variables()))
            assert {s["metric"][m.group(2)] for s in series} == expected[var["name"]]


def _alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def test_every_alert_expression_evaluates(loaded: dict[str, Any]) -> None:
    rules = _alert_rules()
    assert {r["alert"] for r in rules} >= {
        "GpupoolWorkerDown", "GpupoolWorkerCrashLoop", "GpupoolQueueSaturated",
        "VllmKVCacheNearFull", "GpupoolHighErrorRate",
    }  # fmt: skip
    for rule in rules:
        loaded["prom"].query(rule["expr"])
    loaded_rules = [r for g in loaded["prom"].api("rules")["groups"] for r in g["rules"]]
    assert {r["name"] for r in loaded_rules} == {r["alert"] for r in rules}
    assert all(r["health"] == "ok" for r in loaded_rules), loaded_rules
    firing = [a for a in loaded["prom"].api("alerts")["alerts"] if a["state"] == "firing"]
    assert not firing, firing  # a healthy pool raises nothing


def test_killed_worker_leaves_sd_file_and_raises_alert(loaded: dict[str, Any]) -> None:
    gw, prom, sd = loaded["gw"], loaded["prom"], loaded["sd"]
    pid = _workers(gw.url)["small"]["pid"]
    os.kill(pid, signal.SIGKILL)
    _wait("SD file without the killed worker", lambda: set(_sd_entries(sd)) == {"big"})

    def pending() -> list[dict[str, Any]]:
        alerts = prom.api("alerts")["alerts"]
        return [a for a in alerts if a["labels"]["alertname"] == "GpupoolWorkerNotReady"]

    (alert,) = _wait("GpupoolWorkerNotReady for the killed worker", pending, timeout=10)
    assert alert["labels"]["worker"] == "small" and alert["state"] == "pending"
    _wait("the supervisor to restart it", lambda: _states(gw.url)["small"] == "ready")
    _wait("SD file with it again", lambda: set(_sd_entries(sd)) == {"big", "small"})
    query = 'gpupool_worker_restarts_total{worker="small"}'
    restarts = _wait("Prometheus to see the restart", lambda: prom.vector(query))
    assert float(restarts[0]["value"][1]) >= 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-v"]))
