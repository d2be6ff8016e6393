"""Render deploy/kubernetes: ``kubectl kustomize`` where kubectl is installed, and a small
renderer of the few Kustomize features the layout uses where it is not.

The layout keeps to what :func:`render_plain` implements: ``resources`` (files), ``namespace``,
``labels`` (metadata only), ``images``, and ConfigMap/Secret generators from files without name
hashes. Where kubectl exists the test renders both ways and requires the same objects, so the
plain renderer cannot drift from Kustomize unnoticed.
"""

from __future__ import annotations

import base64
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

CLUSTER_SCOPED = {"Namespace", "PersistentVolume", "ClusterRole", "ClusterRoleBinding"}


def kubectl() -> str | None:
    return shutil.which("kubectl")


def render_kubectl(folder: Path) -> list[dict[str, Any]]:
    binary = kubectl()
    assert binary is not None
    out = subprocess.run(
        [binary, "kustomize", str(folder)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def render_plain(folder: Path) -> list[dict[str, Any]]:
    k = yaml.safe_load((folder / "kustomization.yaml").read_text())
    assert k["generatorOptions"] == {"disableNameSuffixHash": True}
    objects = [d for f in k["resources"] for d in yaml.safe_load_all((folder / f).read_text()) if d]
    for gen in k.get("configMapGenerator", []):
        objects.append(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": gen["name"]},
                "data": _files(folder, gen["files"]),
            }
        )
    for gen in k.get("secretGenerator", []):
        data = {
            key: base64.b64encode(v.encode()).decode()
            for key, v in _files(folder, gen["files"]).items()
        }
        objects.append(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": gen["name"]},
                "type": "Opaque",
                "data": data,
            }
        )
    labels = {key: v for entry in k.get("labels", []) for key, v in entry["pairs"].items()}
    images = {i["name"]: i for i in k.get("images", [])}
    for obj in objects:
        meta = obj["metadata"]
        if obj["kind"] not in CLUSTER_SCOPED:
            meta["namespace"] = k["namespace"]
        meta["labels"] = {**meta.get("labels", {}), **labels}
        for c in _containers(obj):
            c["image"] = _image(c["image"], images)
    return objects


def _files(folder: Path, specs: list[str]) -> dict[str, str]:
    out = {}
    for spec in specs:
        key, _, path = spec.partition("=")
        out[key] = (folder / path).read_text()
    return out


def _containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    spec = obj.get("spec", {}).get("template", {}).get("spec", {})
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


def _image(image: str, images: dict[str, dict[str, str]]) -> str:
    name, _, tag = image.partition(":")
    rule = images.get(name)
    if rule is None:
        return image
    return f"{rule.get('newName', name)}:{rule.get('newTag', tag)}".rstrip(":")


def by_kind_and_name(objects: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def secret_text(obj: dict[str, Any], key: str) -> str:
    """A Secret's value, decoded (Kustomize wraps base64 at 76 columns)."""
    return base64.b64decode(obj["data"][key].replace("\n", "")).decode()
