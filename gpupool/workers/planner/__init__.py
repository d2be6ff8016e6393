"""GPU memory planning for vLLM workers, and the configuration checks built on it.

Entry points:

- :func:`load_model_spec` / :func:`parse_model_spec`: a Hugging Face ``config.json`` ->
  :class:`ModelSpec`.
- :func:`plan_from_args`: ``(ModelSpec, PlanArgs) -> Plan``, pure; :func:`plan_args_from_launch`
  builds :class:`PlanArgs` from a ``LaunchConfig.args`` mapping and a GPU size.
- :func:`check_launch_config`, :func:`check_gpu_sharing`, :func:`check_config`: ``Finding`` lists
  for ``gpupool check``.
- ``gpupool.workers.planner.cli``: the ``plan`` and ``gpus`` click commands.
"""

from gpupool.workers.planner.checks import check_config, check_gpu_sharing, check_launch_config
from gpupool.workers.planner.errors import ModelConfigError, PlanArgsError, PlannerError
from gpupool.workers.planner.findings import Finding, Level
from gpupool.workers.planner.launch_args import plan_args_from_launch
from gpupool.workers.planner.model_spec import ModelSpec, load_model_spec, parse_model_spec
from gpupool.workers.planner.plan import Plan, PlanArgs
from gpupool.workers.planner.planning import plan_from_args
from gpupool.workers.planner.workers import WorkerPlan, load_worker_specs, plan_workers

__all__ = [
    "Finding",
    "Level",
    "ModelConfigError",
    "ModelSpec",
    "Plan",
    "PlanArgs",
    "PlanArgsError",
    "PlannerError",
    "WorkerPlan",
    "check_config",
    "check_gpu_sharing",
    "check_launch_config",
    "load_model_spec",
    "load_worker_specs",
    "parse_model_spec",
    "plan_args_from_launch",
    "plan_from_args",
    "plan_workers",
]
