"""Model resolution like vLLM's: a local directory, the Hugging Face cache (its real layout,
read by huggingface_hub), the Hub's config.json only, then a built-in shape; a clear error
naming every place tried. No test reaches the network."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpupool.workers.planner import ModelConfigError, load_model_spec
from gpupool.workers.planner.errors import ModelNotFoundError
from gpupool.workers.planner.resolve import hub_cache_dir, resolve_model
from tests.workers.planner.conftest import MODEL_CONFIGS, put_in_hf_cache


class FakeHub:
    """The Hub as :class:`HubFiles`: files by (repo, name); records every download."""

    def __init__(self, root: Path, files: dict[tuple[str, str], dict[str, object]]) -> None:
        self.root, self.files = root, files
        self.downloads: list[tuple[str, str]] = []

    def cached(self, repo_id: str, filename: str) -> Path | None:
        return None

    def download(self, repo_id: str, filename: str) -> Path | None:
        self.downloads.append((repo_id, filename))
        if (repo_id, filename) not in self.files:
            return None
        path = self.root / repo_id.replace("/", "--") / filename
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.files[repo_id, filename]))
        return path


def test_a_local_directory_wins(tmp_path: Path) -> None:
    found = resolve_model(str(MODEL_CONFIGS / "qwen3.5-9b"))
    assert found.spec == load_model_spec(MODEL_CONFIGS / "qwen3.5-9b")
    assert found.source.startswith("local ") and not found.builtin
    assert found.reasoning_parser == "qwen3"


def test_a_repo_id_is_read_from_the_hf_cache_offline(hf_env: Path) -> None:
    config = MODEL_CONFIGS / "qwen3.5-35b-a3b-awq" / "config.json"
    put_in_hf_cache(hf_env, "cyankiwi/Qwen3.5-35B-A3B-AWQ-4bit", {"config.json": config})
    found = resolve_model("cyankiwi/Qwen3.5-35B-A3B-AWQ-4bit")
    assert "Hugging Face cache" in found.source and str(hf_env) in found.source
    assert not found.builtin
    assert found.spec.quantization_config == load_model_spec(config).quantization_config
    assert found.spec.name == "cyankiwi/Qwen3.5-35B-A3B-AWQ-4bit"


def test_hf_home_is_honoured_when_hf_hub_cache_is_unset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache_dir() == tmp_path / "home" / "hub"
    config = {**json.loads((MODEL_CONFIGS / "qwen3.5-27b" / "config.json").read_text())}
    config["text_config"]["num_hidden_layers"] = 4  # not the built-in shape: proves the source
    config["text_config"]["layer_types"] = config["text_config"]["layer_types"][:4]
    put_in_hf_cache(tmp_path / "home" / "hub", "acme/Custom-27B", {"config.json": config})
    found = resolve_model("acme/Custom-27B")
    assert found.spec.num_layers == 4 and "Hugging Face cache" in found.source


def test_online_only_config_json_is_fetched_and_modelopt_quant_config_merged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE")
    base = json.loads((MODEL_CONFIGS / "qwen3.6-35b-a3b" / "config.json").read_text())
    quant = {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4"}}
    hub = FakeHub(tmp_path / "dl", {
        ("acme/Model-NVFP4", "config.json"): base,
        ("acme/Model-NVFP4", "hf_quant_config.json"): quant,
    })  # fmt: skip
    found = resolve_model("acme/Model-NVFP4", hub=hub)
    assert hub.downloads == [
        ("acme/Model-NVFP4", "config.json"),
        ("acme/Model-NVFP4", "hf_quant_config.json"),
    ]  # never a weight file
    assert found.source.startswith("the Hub, config.json only")
    assert found.spec.quantization_config == {"quant_method": "modelopt", "quant_algo": "NVFP4"}


def test_offline_never_asks_the_hub_and_falls_back_to_a_built_in_shape(tmp_path: Path) -> None:
    hub = FakeHub(tmp_path, {})
    found = resolve_model("Qwen/Qwen3.5-122B-A10B-FP8", hub=hub)
    assert hub.downloads == []
    assert found.builtin and found.source == "built-in shape Qwen3.5-122B-A10B + fp8 template"
    assert found.spec.quantization_config is not None
    assert found.spec.quantization_config["quant_method"] == "fp8"


def test_a_hub_failure_falls_back_to_a_built_in_shape(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE")

    class Unreachable(FakeHub):
        def download(self, repo_id: str, filename: str) -> Path | None:
            raise ConnectionError("Name or service not known")

    found = resolve_model("Kbenkhaled/Qwen3.5-27B-NVFP4", hub=Unreachable(tmp_path, {}))
    assert found.builtin and "Qwen3.5-27B + nvfp4" in found.source


def test_a_missing_local_path_named_like_a_known_model_uses_its_shape() -> None:
    # seed 001's example: /data/models/qwen3.5-27b exists only on the guide's machine
    found = resolve_model("/data/models/qwen3.5-27b", hint="Qwen/Qwen3.5-27B")
    assert found.builtin and found.source == "built-in shape Qwen3.5-27B"
    assert found.spec.name == "/data/models/qwen3.5-27b"


def test_nothing_found_names_every_place_tried(hf_env: Path) -> None:
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model("acme/Unknown-7B")
    message = str(err.value)
    assert f"Hugging Face cache {hf_env}: no acme/Unknown-7B config.json" in message
    assert "the Hub: not asked, HF_HUB_OFFLINE is set" in message
    assert "built-in shapes: none for `acme/Unknown-7B`" in message
    assert "Qwen3.5-397B-A17B" in message  # the known shapes are listed
    assert isinstance(err.value, ModelConfigError)


def test_a_broken_cached_config_is_an_error_not_a_fallback(hf_env: Path) -> None:
    snapshot = put_in_hf_cache(hf_env, "acme/Broken", {"config.json": {"architectures": []}})
    (snapshot / "config.json").unlink()
    (snapshot / "config.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match="not valid JSON"):
        resolve_model("acme/Broken")
