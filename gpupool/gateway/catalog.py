"""Model names and aliases, and the `/v1/models` cards built from ready workers."""

from __future__ import annotations

import time
import uuid
from typing import Any

from gpupool.config.models import ModelConfig
from gpupool.gateway.errors import Forbidden, ModelNotFound
from gpupool.workers.registry import Registry


class Catalog:
    def __init__(self, models: list[ModelConfig]) -> None:
        self._by_name: dict[str, ModelConfig] = {}
        for m in models:
            for n in (m.name, *m.aliases):
                self._by_name[n] = m
        self._default = models[0]
        self._created = int(time.time())

    def resolve(self, name: str | None, allowed: frozenset[str] | None = None) -> ModelConfig:
        """The model a request names (or the first model when it names none, as vLLM).

        ``allowed``: the names a key may use (None: all). A key sees only those, in errors
        too: an unknown name lists only its models; a model it may not use is a 403.
        """
        if name is None:
            return self._default_for(allowed)
        m = self._by_name.get(name)
        if m is None:
            raise ModelNotFound(name, self.names(allowed))
        if allowed is not None and not self._permits(m, allowed):
            raise Forbidden(f"This key may not use model `{name}`.", param="model")
        return m

    def _default_for(self, allowed: frozenset[str] | None) -> ModelConfig:
        if allowed is None or self._permits(self._default, allowed):
            return self._default
        for n in self.names(allowed):
            return self._by_name[n]
        raise Forbidden("This key may not use any model.", param="model")

    @staticmethod
    def _permits(m: ModelConfig, allowed: frozenset[str]) -> bool:
        return m.name in allowed or any(a in allowed for a in m.aliases)

    def names(self, allowed: frozenset[str] | None = None) -> list[str]:
        return sorted(n for n, m in self._by_name.items()
                      if allowed is None or self._permits(m, allowed))  # fmt: skip

    def cards(
        self, registry: Registry, allowed: frozenset[str] | None = None
    ) -> list[dict[str, Any]]:
        cards = []
        for name, m in self._by_name.items():
            if allowed is not None and not self._permits(m, allowed):
                continue
            windows = [w.window or 0 for w in registry.serving_of_model(m.name)]
            if windows:
                cards.append(self._card(name, m, max(windows)))
        return cards

    def card(
        self, name: str, registry: Registry, allowed: frozenset[str] | None = None
    ) -> dict[str, Any]:
        cards = self.cards(registry, allowed)
        for c in cards:
            if c["id"] == name:
                return c
        raise ModelNotFound(name, [c["id"] for c in cards])

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
