"""One default TLS context per process for every HTTP client a test makes (a pytest plugin,
loaded by ``tests/conftest.py``).

httpx, and httpx2 under the ``openai`` and ``anthropic`` SDKs, build a new ``ssl.SSLContext`` for
every client, loading the whole certificate bundle (certifi's, or the one ``SSL_CERT_FILE``
names) each time: 16 ms of CPU (measured at ``fdcc3cf``) for every ``httpx.get``, every
``openai.OpenAI()`` and ``anthropic.Anthropic()``, against 0.5 ms for a request with the
context at hand. The tests make thousands, many in loops that poll a server for a state. Here
the default context (``verify=True``, no client certificate) is built once per process and
environment, and shared: a context is safe to share between clients and threads, and nothing
the tests do changes it. Any other ``verify`` gets its own, as before. The tests talk plain
HTTP on loopback.

Each transport calls the ``create_ssl_context`` it imported by name; if a new release moves it,
the ``getattr`` below fails loudly rather than the suite quietly paying the cost again.
"""

from __future__ import annotations

import functools
import importlib
import os
import ssl
from collections.abc import Callable
from typing import Any

Create = Callable[..., ssl.SSLContext]


def _shared(create: Create) -> Create:
    @functools.cache
    def default(trust_env: bool, env: tuple[str | None, str | None]) -> ssl.SSLContext:
        return create(trust_env=trust_env)  # the same environment gives the same context

    def create_ssl_context(verify: Any = True, cert: Any = None, trust_env: bool = True) -> Any:
        if verify is True and cert is None:
            return default(trust_env, (os.getenv("SSL_CERT_FILE"), os.getenv("SSL_CERT_DIR")))
        return create(verify=verify, cert=cert, trust_env=trust_env)

    return create_ssl_context


def _install(module_name: str) -> None:
    try:
        module = importlib.import_module(module_name)
    except ImportError:  # httpx2 comes with the SDKs; without them nothing uses it
        return
    setattr(module, "create_ssl_context", _shared(module.create_ssl_context))  # noqa: B010


for _name in ("httpx._transports.default", "httpx2._transports.default"):
    _install(_name)
