"""Model names and aliases, and the `/v1/models` cards built from ready workers."""

from __future__ import annotations

import time
import uuid
from typing import Any

from gpupool.config.models import ModelConfig
from gpupool.gateway.errors import ModelNotFound
from gpupool.workers.registry import Registry


class Catalog:
    def __init__(self, models: list[ModelConfig]) -> None:
        self._by_name: dict[str, ModelConfig] = {}
        for m in models:
            for n in (m.name, *m.aliases):
                self._by_name[n] = m
        self._default = models[0]
        self._created = int(time.time())

    def resolve(self, name: str | None) -> ModelConfig:
        """The model a request names (or the first model when it names none, as vLLM)."""
        if name is None:
            return self._default
        m = self._by_name.get(name)
        if m is None:
            raise ModelNotFound(name, sorted(self._by_name))
        return m

    def names(self) -> list[str]:
        return sorted(self._by_name)

    def cards(self, registry: Registry) -> list[dict[str, Any]]:
        cards = []
        for name, m in self._by_name.items():
            windows = [w.window or 0 for w in registry.ready_of_model(m.name)]
            if windows:
                cards.append(self._card(name, m, max(windows)))
        return cards

    def card(self, name: str, registry: Registry) -> dict[str, Any]:
        for c in self.cards(registry):
            if c["id"] == name:
                return c
        raise ModelNotFound(name, [c["id"] for c in self.cards(registry)])

    def _card(self, name: str, m: ModelConfig, window: int) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": self._created,
            "owned_by": "vllm",
            "root": m.name,
            "parent": None,
            "max_model_len": window or None,
            "permission": [
                {
                    "id": f"modelperm-{uuid.uuid4().hex}",
                    "object": "model_permission",
                    "created": self._created,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }
