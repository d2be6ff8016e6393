"""Per-key limits: requests per minute, tokens per minute (reserved up front), concurrency.

``service.py``: :class:`KeyLimits` and its :class:`Hold` (the request path's calls);
``base.py``: the store contract and the window rules; ``memory.py`` and ``redis_store.py``: the
two stores (one process; every replica through Redis).
"""

from gpupool.gateway.security.limits.base import Policy, Usage
from gpupool.gateway.security.limits.service import NO_HOLD, Hold, KeyLimits, close_after

__all__ = ["NO_HOLD", "Hold", "KeyLimits", "Policy", "Usage", "close_after"]
