"""deploy/kubernetes rendered and checked without a cluster (none runs here).

Rendered with ``kubectl kustomize`` where kubectl is installed (and with the plain renderer in
tests/deploy/kustomize.py, which must agree), then every object validated against the
Kubernetes OpenAPI schema of the newest release kubernetes-validate knows (strict: unknown
fields are errors). Then what makes it a gpupool deployment: the gateway configurations load
with gpupool's own loader, the gateways discover exactly the workers' headless Services, the
probes, GPU requests, scrape annotations, disruption budgets and the admin key's Secret.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gpupool.config import parse_config
from gpupool.config.models import GpupoolConfig
from tests.deploy.kustomize import (
    by_kind_and_name,
    kubectl,
    render_kubectl,
    render_plain,
    secret_text,
)
from tests.support.procs import ROOT

K8S = ROOT / "deploy" / "kubernetes"
SEED000 = ROOT / "config" / "examples" / "seed000-pro6000-5090.yaml"
Objects = dict[tuple[str, str], dict[str, Any]]


@pytest.fixture(scope="module")
def objects() -> Objects:
    plain = by_kind_and_name(render_plain(K8S))
    if kubectl() is None:
        return plain
    rendered = by_kind_and_name(render_kubectl(K8S))
    assert rendered.keys() == plain.keys()
    for key, obj in rendered.items():
        if key[0] == "Secret":
            assert secret_text(obj, "gpupool.yaml") == secret_text(plain[key], "gpupool.yaml")
            obj, other = {**obj, "data": None}, {**plain[key], "data": None}
        else:
            other = plain[key]
        assert obj == other, key
    return rendered


def test_every_object_matches_the_kubernetes_schema(objects: Objects) -> None:
    version = kubernetes_validate.latest_version()
    for key, obj in objects.items():
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{key}: {e.message} at {'/'.join(map(str, e.path))}")


def test_the_schema_check_is_not_vacuous(objects: Objects) -> None:
    version = kubernetes_validate.latest_version()
    broken = yaml.safe_load(yaml.safe_dump(objects[("Deployment", "gpupool-gateway")]))
    broken["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"httpGet": {}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, version, strict=True)


def _pod(obj: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = obj["spec"]["template"]["spec"]
    return spec


def _selects(selector: dict[str, str], obj: dict[str, Any]) -> bool:
    labels = obj["spec"]["template"]["metadata"]["labels"]
    return all(labels.get(k) == v for k, v in selector.items())


def _gateway_config(objects: Objects) -> GpupoolConfig:
    text = secret_text(objects[("Secret", "gpupool-gateway")], "gpupool.yaml")
    return parse_config(yaml.safe_load(text))


def test_gateways_discover_every_worker_statefulset(objects: Objects) -> None:
    cfg = _gateway_config(objects)
    ns = objects[("Namespace", "gpupool")]["metadata"]["name"]
    sets = {name: o for (kind, name), o in objects.items() if kind == "StatefulSet"}
    assert len(sets) >= 2  # one per GPU type
    found = {}
    for wc in cfg.workers:
        assert wc.discover is not None and wc.url is None and wc.launch is None
        found[wc.discover.dns] = wc
    for name, sts in sets.items():
        svc = objects[("Service", sts["spec"]["serviceName"])]
        assert svc["spec"]["clusterIP"] == "None", f"{name}: its Service is not headless"
        assert _selects(svc["spec"]["selector"], sts)
        wc = found[f"{svc['metadata']['name']}.{ns}.svc.cluster.local"]
        (port,) = svc["spec"]["ports"]
        assert wc.discover is not None and wc.discover.port == port["port"]
        (container,) = _pod(sts)["containers"]
        assert container["image"].split(":")[0].endswith("gpupool-worker")
        gpus = container["resources"]["limits"]["nvidia.com/gpu"]
        assert gpus == container["resources"]["requests"]["nvidia.com/gpu"] == 1
        assert _pod(sts)["nodeSelector"]["nvidia.com/gpu.product"]
    assert len(found) == len(sets)
    redis = objects[("Service", "redis")]
    assert cfg.queue.backend.value == "redis"
    assert cfg.queue.redis_url.startswith(f"redis://redis.{ns}.svc.cluster.local:")
    assert redis["spec"]["ports"][0]["port"] == 6379


def test_probes_ask_health_and_ready(objects: Objects) -> None:
    pods = [("Deployment", "gpupool-gateway")] + [k for k in objects if k[0] == "StatefulSet"]
    for key in pods:
        (c,) = _pod(objects[key])["containers"]
        assert c["readinessProbe"]["httpGet"]["path"] == "/ready", key
        assert c["livenessProbe"]["httpGet"]["path"] == "/health", key
        ann = objects[key]["spec"]["template"]["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/path"] == "/metrics"
        port = next(p["containerPort"] for p in c["ports"] if p["name"] == "http")
        assert ann["prometheus.io/port"] == str(port) == "8000"


def test_gateway_replicas_budget_and_admin_key_secret(objects: Objects) -> None:
    gw = objects[("Deployment", "gpupool-gateway")]
    assert gw["spec"]["replicas"] >= 2
    pdb = objects[("PodDisruptionBudget", "gpupool-gateway")]
    assert _selects(pdb["spec"]["selector"]["matchLabels"], gw)
    assert pdb["spec"]["minAvailable"] < gw["spec"]["replicas"]
    for key, obj in objects.items():
        if key[0] == "StatefulSet":
            budget = objects[("PodDisruptionBudget", key[1])]
            assert _selects(budget["spec"]["selector"]["matchLabels"], obj)
    pod = _pod(gw)
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == 10001
    (config,) = [v for v in pod["volumes"] if v["name"] == "config"]
    assert config["secret"]["secretName"] == "gpupool-gateway"
    cfg = _gateway_config(objects)
    assert cfg.auth.enabled and cfg.auth.admin_key_sha256 and cfg.auth.metrics_open
    (c,) = pod["containers"]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert c["args"] == ["serve", "--config", f"{mounts['config']}/gpupool.yaml"]
    assert mounts["state"] == cfg.server.state_dir


def test_worker_pods_run_seed000_with_the_gpu_cache_on_a_volume(objects: Objects) -> None:
    seed = {w.name: w for w in parse_config(yaml.safe_load(SEED000.read_text())).workers}
    for gpu, seed_worker in (("rtx-pro-6000", "big"), ("rtx-5090", "small")):
        cm = objects[("ConfigMap", f"gpupool-worker-{gpu}")]
        cfg = parse_config(yaml.safe_load(cm["data"]["gpupool.yaml"]))
        (wc,) = cfg.workers
        want = seed[seed_worker]
        assert wc.launch is not None and want.launch is not None
        assert wc.launch.args == want.launch.args and wc.warmup == want.warmup
        assert wc.launch.gpus == [0]  # the pod's one GPU
        sts = objects[("StatefulSet", f"vllm-{gpu}")]
        (c,) = _pod(sts)["containers"]
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        assert mounts["state"] == cfg.server.state_dir
        assert mounts["gpu-cache"] == f"{cfg.server.state_dir}/cache"  # <state_dir>/cache/<sm>
        claims = {v["name"]: v for v in _pod(sts)["volumes"] if "persistentVolumeClaim" in v}
        claim = claims["gpu-cache"]["persistentVolumeClaim"]["claimName"]
        pvc = objects[("PersistentVolumeClaim", claim)]
        assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    # seed 000's start_after: the 5090 pods wait for a ready (warmed) RTX PRO 6000 pod
    (init,) = _pod(objects[("StatefulSet", "vllm-rtx-5090")])["initContainers"]
    assert "vllm-rtx-pro-6000" in " ".join(init["command"])


def test_layout_files_are_all_used() -> None:
    k = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    used = set(k["resources"])
    used |= {
        f.partition("=")[2]
        for g in k["configMapGenerator"] + k["secretGenerator"]
        for f in g["files"]
    }
    files = {str(p.relative_to(K8S)) for p in K8S.rglob("*.yaml")} - {"kustomization.yaml"}
    assert files == used, files ^ used


def test_kustomize_is_what_renders_here() -> None:
    """Say which renderer ran (kubectl here; the plain one where it is missing)."""
    if kubectl() is None:
        pytest.skip("kubectl is not installed: rendered with tests/deploy/kustomize.py only")
    assert Path(str(kubectl())).exists()
