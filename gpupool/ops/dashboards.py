"""Grafana dashboards as code (``grafana-foundation-sdk``), rendered by docker/grafana/generate.py.

One dashboard, ``gpupool``, with a row per question an operator asks:

- Workers: which are up, how often they restart, how much capacity is ready.
- Traffic: requests and tokens per second, by worker and status; errors and retries.
- Latency: request duration, time to first token and gaps between chunks (histogram quantiles).
- Capacity and queue: in flight against capacity, queue depth, queue wait, admission outcomes.
- vLLM per GPU: KV-cache usage, running/waiting requests, tokens, TTFT and preemptions, read
  from the workers' own ``/metrics`` (found through gpupool's SD file, labelled ``gpus``).

Variables: ``$datasource``, ``$model``, ``$worker``, ``$gpu`` (all multi-value regexes whose
"All" is ``.*``, so workers without a ``gpus`` label still show under "All").
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from grafana_foundation_sdk.builders import common as common_b
from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.builders import prometheus, stat, statetimeline, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as model

UID = "gpupool-overview"
DATASOURCE = model.DataSourceRef(type_val="prometheus", uid="${datasource}")
GW = 'model=~"$model", worker=~"$worker"'
"""Selector for gateway series."""
VLLM = 'model=~"$model", worker=~"$worker", gpus=~"$gpu"'
"""Selector for vLLM series scraped through the SD file."""
RATE = "$__rate_interval"
DASHED = model.DynamicConfigValue(
    id_val="custom.lineStyle", value={"fill": "dash", "dash": [10, 10]}
)


@dataclass(frozen=True, slots=True)
class Query:
    expr: str
    legend: str


def quantiles(metric: str, selector: str, by: str, qs: Sequence[float]) -> list[Query]:
    """``histogram_quantile`` of ``<metric>_bucket`` per ``by``, one query per quantile."""
    legend = " · ".join("{{" + label.strip() + "}}" for label in by.split(","))
    return [
        Query(
            f"histogram_quantile({q}, sum by ({by}, le) "
            f"(rate({metric}_bucket{{{selector}}}[{RATE}])))",
            f"p{round(q * 100)} {legend}",
        )
        for q in qs
    ]


def _targets(queries: Iterable[Query]) -> list[prometheus.Dataquery]:
    return [
        prometheus.Dataquery().expr(q.expr).legend_format(q.legend).ref_id(chr(ord("A") + i))
        for i, q in enumerate(queries)
    ]


def graph(
    title: str, unit: str, queries: Sequence[Query], description: str, span: int = 12
) -> timeseries.Panel:
    panel = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .min(0)
        .span(span)
        .height(8)
        .fill_opacity(10)
        .legend(
            common_b.VizLegendOptions()
            .display_mode(common.LegendDisplayMode.TABLE)
            .placement(common.LegendPlacement.BOTTOM)
            .show_legend(True)
            .calcs(["lastNotNull", "max"])
        )
    )
    for target in _targets(queries):
        panel = panel.with_target(target)
    return panel


def thresholds(*steps: tuple[float | None, str]) -> dash.ThresholdsConfig:
    return (
        dash.ThresholdsConfig()
        .mode(model.ThresholdsMode.ABSOLUTE)
        .steps([model.Threshold(value=v, color=c) for v, c in steps])
    )


def _variable(name: str, label: str, query: str) -> dash.QueryVariable:
    return (
        dash.QueryVariable(name)
        .label(label)
        .datasource(DATASOURCE)
        .query(query)
        .refresh(model.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .sort(model.VariableSort.ALPHABETICAL_ASC)
    )


def variables() -> list[dash.DatasourceVariable | dash.QueryVariable]:
    return [
        dash.DatasourceVariable("datasource").label("Data source").type("prometheus"),
        _variable("model", "Model", "label_values(gpupool_worker_up, model)"),
        _variable("worker", "Worker", 'label_values(gpupool_worker_up{model=~"$model"}, worker)'),
        _variable("gpu", "GPU", 'label_values(vllm:kv_cache_usage_perc{worker=~"$worker"}, gpus)'),
    ]


def worker_panels() -> list[Any]:
    up = (
        statetimeline.Panel()
        .title("Worker up")
        .description("1 (up) while the gateway routes to the worker: state `ready`.")
        .datasource(DATASOURCE)
        .span(12)
        .height(8)
        .with_target(
            _targets([Query(f"max by (worker) (gpupool_worker_up{{{GW}}})", "{{worker}}")])[0]
        )
        .mappings(
            [
                model.ValueMap(
                    options={
                        "0": model.ValueMappingResult(text="down", color="red"),
                        "1": model.ValueMappingResult(text="up", color="green"),
                    }
                )
            ]
        )
        .thresholds(thresholds((None, "red"), (1, "green")))
    )
    ready_capacity = (
        stat.Panel()
        .title("Ready capacity")
        .description("Concurrent requests the ready workers accept (sum of their capacity).")
        .datasource(DATASOURCE)
        .span(4)
        .height(8)
        .with_target(
            _targets(
                [
                    Query(
                        f"sum by (model) (gpupool_worker_capacity{{{GW}}} "
                        f"* on (model, worker) gpupool_worker_up{{{GW}}})",
                        "{{model}}",
                    )
                ]
            )[0]
        )
        .thresholds(thresholds((None, "red"), (1, "green")))
    )
    restarts = graph(
        "Restarts",
        "short",
        [
            Query(
                f"sum by (worker) (increase(gpupool_worker_restarts_total{{{GW}}}[{RATE}]))",
                "{{worker}}",
            )
        ],
        "Supervisor restarts of launched workers (a crash loop shows as a staircase).",
        span=8,
    )
    return [up, ready_capacity, restarts]


def traffic_panels() -> list[Any]:
    reqs = f"gpupool_requests_total{{{GW}}}"
    return [
        graph(
            "Requests/s by worker",
            "reqps",
            [Query(f"sum by (worker) (rate({reqs}[{RATE}]))", "{{worker}}")],
            "Answered requests per second, by the worker that answered.",
            span=8,
        ),
        graph(
            "Requests/s by status",
            "reqps",
            [Query(f"sum by (status) (rate({reqs}[{RATE}]))", "{{status}}")],
            "Answered requests per second, by HTTP status.",
            span=8,
        ),
        graph(
            "Tokens/s",
            "short",
            [
                Query(
                    f"sum by (worker, kind) (rate(gpupool_tokens_total{{{GW}}}[{RATE}]))",
                    "{{worker}} {{kind}}",
                )
            ],
            "Prompt and completion tokens per second, from the usage of each response.",
            span=8,
        ),
        graph(
            "Error ratio (5xx)",
            "percentunit",
            [
                Query(
                    f'(sum(rate(gpupool_requests_total{{{GW}, status=~"5.."}}[{RATE}])) '
                    f"or vector(0)) / sum(rate({reqs}[{RATE}]))",
                    "5xx share",
                )
            ],
            "Share of answered requests that ended in a 5xx.",
            span=8,
        ),
        graph(
            "Errors/s by cause",
            "short",
            [
                Query(
                    f"sum by (worker, cause) (rate(gpupool_errors_total{{{GW}}}[{RATE}]))",
                    "{{worker}} {{cause}}",
                )
            ],
            "Errors the gateway saw, by worker and cause.",
            span=8,
        ),
        graph(
            "Upstream retries/s",
            "short",
            [
                Query(
                    f"sum by (worker, reason) "
                    f"(rate(gpupool_upstream_retries_total{{{GW}}}[{RATE}]))",
                    "{{worker}} {{reason}}",
                )
            ],
            "Requests moved to another worker before any byte was sent, by the failed worker.",
            span=8,
        ),
    ]


def latency_panels() -> list[Any]:
    return [
        graph(
            "Request duration",
            "s",
            quantiles("gpupool_request_duration_seconds", GW, "worker", (0.5, 0.95)),
            "End-to-end time at the gateway, per worker.",
            span=8,
        ),
        graph(
            "Time to first token",
            "s",
            quantiles("gpupool_time_to_first_token_seconds", GW, "worker", (0.5, 0.95)),
            "Time to the first streamed byte, per worker (streaming requests).",
            span=8,
        ),
        graph(
            "Gap between chunks",
            "s",
            quantiles("gpupool_inter_chunk_seconds", GW, "worker", (0.5, 0.95)),
            "Inter-chunk latency of streams, per worker (decode speed as clients feel it).",
            span=8,
        ),
    ]


def capacity_panels() -> list[Any]:
    inflight = graph(
        "In flight vs capacity",
        "short",
        [
            Query(f"sum by (worker) (gpupool_inflight{{{GW}}})", "{{worker}} in flight"),
            Query(f"sum by (worker) (gpupool_worker_capacity{{{GW}}})", "{{worker}} capacity"),
        ],
        "Requests in flight per worker against its capacity (dashed).",
    ).override_by_regexp(".* capacity", [DASHED])
    model_sel = 'model=~"$model"'
    return [
        inflight,
        graph(
            "Load (in flight / capacity)",
            "percentunit",
            [
                Query(
                    f"sum by (worker) (gpupool_inflight{{{GW}}}) "
                    f"/ sum by (worker) (gpupool_worker_capacity{{{GW}}})",
                    "{{worker}}",
                )
            ],
            "Each worker's share of its capacity in use: what routing balances.",
        ),
        graph(
            "Queue depth",
            "short",
            [Query(f"sum by (model) (gpupool_queue_depth{{{model_sel}}})", "{{model}}")],
            "Requests waiting for a slot, per model.",
            span=8,
        ),
        graph(
            "Queue wait",
            "s",
            quantiles("gpupool_queue_wait_seconds", model_sel, "model", (0.5, 0.95)),
            "Time admitted requests waited for a slot, per model.",
            span=8,
        ),
        graph(
            "Admission decisions/s",
            "short",
            [
                Query(
                    f"sum by (decision, reason) "
                    f"(rate(gpupool_admission_decisions_total{{{model_sel}}}[{RATE}]))",
                    "{{decision}} {{reason}}",
                )
            ],
            "Immediate, queued and rejected requests per second.",
            span=8,
        ),
    ]


def vllm_panels() -> list[Any]:
    by = "worker, gpus"
    legend = "GPU {{gpus}} · {{worker}}"
    kv = graph(
        "vLLM KV-cache usage",
        "percentunit",
        [Query(f"max by ({by}) (vllm:kv_cache_usage_perc{{{VLLM}}})", legend)],
        "vllm:kv_cache_usage_perc per GPU; above 80% for long, the worker is at its KV limit.",
    ).thresholds(thresholds((None, "green"), (0.8, "orange"), (0.9, "red")))
    kv = kv.max(1).thresholds_style(
        common_b.GraphThresholdsStyleConfig().mode(common.GraphTresholdsStyleMode.LINE)
    )
    return [
        kv,
        graph(
            "vLLM requests running / waiting",
            "short",
            [
                Query(f"sum by ({by}) (vllm:num_requests_running{{{VLLM}}})", f"running {legend}"),
                Query(f"sum by ({by}) (vllm:num_requests_waiting{{{VLLM}}})", f"waiting {legend}"),
            ],
            "Requests in vLLM's batch and in its own waiting queue, per GPU.",
        ),
        graph(
            "vLLM tokens/s",
            "short",
            [
                Query(
                    f"sum by ({by}) (rate(vllm:generation_tokens_total{{{VLLM}}}[{RATE}]))",
                    f"generated {legend}",
                ),
                Query(
                    f"sum by ({by}) (rate(vllm:prompt_tokens_total{{{VLLM}}}[{RATE}]))",
                    f"prompt {legend}",
                ),
            ],
            "Prefill and decode throughput per GPU.",
        ),
        graph(
            "vLLM time to first token",
            "s",
            quantiles("vllm:time_to_first_token_seconds", VLLM, by, (0.5, 0.95)),
            "vLLM's own TTFT per GPU (the gateway's TTFT minus routing and queueing).",
        ),
        graph(
            "vLLM preemptions",
            "short",
            [
                Query(
                    f"sum by ({by}) (increase(vllm:num_preemptions_total{{{VLLM}}}[{RATE}]))",
                    legend,
                )
            ],
            "Requests evicted from the KV cache to be recomputed: the cache is too small.",
        ),
        graph(
            "vLLM prefix-cache hit rate",
            "percentunit",
            [
                Query(
                    f"sum by ({by}) (rate(vllm:prefix_cache_hits_total{{{VLLM}}}[{RATE}])) "
                    f"/ sum by ({by}) (rate(vllm:prefix_cache_queries_total{{{VLLM}}}[{RATE}]))",
                    legend,
                )
            ],
            "Share of prompt tokens served from the prefix cache, per GPU.",
        ),
    ]


def swap_panels() -> list[Any]:
    """Models taking turns on a GPU (sleep mode, issue 28)."""
    switches = graph(
        "Switches", "short",
        [Query(f"sum by (group, model) (increase(gpupool_swap_switches_total{{{_MODEL}}}"
               f"[{RATE}]))", "{{group}} → {{model}}")],
        "Times a swap group's GPU went to a model (the model woken).", span=8,
    )  # fmt: skip
    seconds = graph(
        "Switch time", "s",
        quantiles("gpupool_swap_switch_seconds", _MODEL, "model", (0.5, 0.95)),
        "From the decision to switch to the woken worker ready: the running requests' end, the "
        "sleep and the wake.", span=8,
    )  # fmt: skip
    asleep = graph(
        "Asleep and waiting for a switch", "short",
        [Query(f'sum by (model) (gpupool_worker_state{{{GW}, state="asleep"}})',
               "asleep {{model}}"),
         Query(f"sum by (model) (increase(gpupool_swap_waited_requests_total{{{_MODEL}}}"
               f"[{RATE}]))", "waited {{model}}")],
        "Workers asleep, and requests that waited in the queue for their model to be woken.",
        span=8,
    )  # fmt: skip
    return [switches, seconds, asleep]


_MODEL = 'model=~"$model"'


ROWS = (
    ("Workers", worker_panels),
    ("Traffic", traffic_panels),
    ("Latency", latency_panels),
    ("Capacity and queue", capacity_panels),
    ("vLLM per GPU (workers' own /metrics)", vllm_panels),
    ("Models taking turns (sleep mode)", swap_panels),
)


def overview() -> dash.Dashboard:
    board = (
        dash.Dashboard("gpupool")
        .uid(UID)
        .description("gpupool gateway and its vLLM workers, per worker and per GPU.")
        .tags(["gpupool", "vllm"])
        .time("now-1h", "now")
        .refresh("10s")
        .timezone("browser")
    )
    for v in variables():
        board = board.with_variable(v)
    for title, panels in ROWS:
        board = board.with_row(dash.Row(title))
        for panel in panels():
            board = board.with_panel(panel)
    return board


def render(board: dash.Dashboard) -> str:
    """The dashboard as JSON text, panels numbered in order (stable output for diffs)."""
    data: dict[str, Any] = json.loads(json.dumps(board.build(), cls=JSONEncoder))
    for i, panel in enumerate(data.get("panels", []), start=1):
        panel["id"] = i
    return json.dumps(data, indent=2) + "\n"


def dashboards() -> dict[str, str]:
    """File name → JSON text of every dashboard gpupool ships."""
    return {"gpupool.json": render(overview())}
