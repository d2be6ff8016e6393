"""What a web page may make a browser send here: nothing that changes state from another site,
and nothing at all from a page whose own name was pointed at this gateway (DNS rebinding).

A browser lets any page send a "simple" request (a form post, ``fetch(mode: "no-cors")``) to
any address, cookies or not, without asking the server first; it only hides the answer. With
auth on that is harmless (no page can attach the key: the ``Authorization`` header would need a
CORS preflight, which the gateway never grants). With auth off, the default on loopback, such a
request would act: drain workers, reload the config, spend the GPUs. So, per request:

    every route, always:  a body-carrying method (POST, PUT, PATCH, DELETE) with a
                          ``Content-Type`` that is not JSON → 415. Every route here reads JSON
                          or no body; text/plain, form and multipart bodies are what a page
                          can send without a preflight (vLLM's FastAPI refuses them as well).
                          No ``Content-Type`` at all stays accepted (curl ``-X POST``).
    auth off, such a method:
                          ``Sec-Fetch-Site: cross-site`` or ``same-site`` → 403;
                          an ``Origin`` that is not this request's own (``Host``), or
                          ``Origin: null`` → 403. SDKs and curl send neither header.
    auth off, /admin/* and the pool page, any method:
                          a ``Host`` that is not an IP address, ``localhost``, a
                          ``*.localhost`` name or one of ``auth.allowed_hosts`` → 403: a
                          rebinding page is same-origin with itself, so only its name gives
                          it away.

The pool page's own ``fetch()`` calls are same-origin (``Sec-Fetch-Site: same-origin``, its
own ``Origin``) and pass. A reverse proxy in front must pass the client's ``Host`` on
(nginx: ``proxy_set_header Host $host``) for the page's actions to match their ``Origin``.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Container
from dataclasses import dataclass

from gpupool.gateway.errors import Forbidden, UnsupportedMediaType

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_DEFAULT_PORTS = {b"http": b"80", b"https": b"443"}


@dataclass(frozen=True, slots=True)
class BrowserGuard:
    """One configuration's rules (``auth.enabled``, ``auth.allowed_hosts``)."""

    auth_off: bool
    hosts: frozenset[str]  # names allowed besides IP addresses and localhost
    page_paths: Container[str]  # the pool page's files (with /admin/*: guarded by Host)

    @classmethod
    def of(cls, auth_off: bool, hosts: list[str], page_paths: Container[str]) -> BrowserGuard:
        return cls(auth_off, frozenset(h.lower().rstrip(".") for h in hosts), page_paths)

    def check(self, method: str, path: str, headers: list[tuple[bytes, bytes]]) -> None:
        """Raise ``UnsupportedMediaType`` or ``Forbidden`` for a request a page may have made
        on another site's behalf; return for every other."""
        host = origin = site = ctype = None
        for k, v in headers:
            if k == b"host":
                host = v
            elif k == b"origin":
                origin = v
            elif k == b"sec-fetch-site":
                site = v
            elif k == b"content-type":
                ctype = v
        unsafe = method not in SAFE_METHODS
        if unsafe and ctype is not None and not is_json(ctype):
            raise UnsupportedMediaType(
                f"Content-Type `{ctype.decode('latin-1')[:100]}` is not accepted: every route "
                "of this gateway takes a JSON body (`Content-Type: application/json`) or none."
            )
        if not self.auth_off:
            return
        if unsafe and (site in (b"cross-site", b"same-site") or not _own_origin(origin, host)):
            raise Forbidden(
                "A request from another web site may not change anything here (auth is off); "
                "send it from a program, or from this gateway's own page."
            )
        if (path.startswith("/admin") or path in self.page_paths) and not self._host_ok(host):
            raise Forbidden(
                "This host name is not one this gateway answers to for the admin API and the "
                "pool page while auth is off; open it by IP address or localhost, or add the "
                "name to `auth.allowed_hosts`."
            )

    def _host_ok(self, host: bytes | None) -> bool:
        if host is None:
            return True  # HTTP/1.0 without Host: not a browser
        name = _hostname(host.decode("latin-1")).lower().rstrip(".")
        if name == "localhost" or name.endswith(".localhost") or name in self.hosts:
            return True
        try:
            ipaddress.ip_address(name)
        except ValueError:
            return False
        return True


def is_json(ctype: bytes) -> bool:
    """``application/json`` or ``application/<anything>+json``, parameters aside."""
    media = ctype.partition(b";")[0].strip().lower()
    return media == b"application/json" or (
        media.startswith(b"application/") and media.endswith(b"+json")
    )


def _own_origin(origin: bytes | None, host: bytes | None) -> bool:
    """No ``Origin`` (not a browser, or a same-origin GET), or one naming this very ``Host``."""
    if origin is None:
        return True
    scheme, sep, netloc = origin.strip().lower().partition(b"://")
    if not sep or host is None:
        return False  # `null` (a sandboxed frame, a file: page), or nothing to compare with
    return _netloc(scheme, netloc) == _netloc(scheme, host.strip().lower())


def _netloc(scheme: bytes, netloc: bytes) -> bytes:
    default = _DEFAULT_PORTS.get(scheme)
    if default is not None and netloc.endswith(b":" + default):
        return netloc[: -len(default) - 1]
    return netloc


def _hostname(host: str) -> str:
    """``Host`` without its port (``[::1]:8000`` → ``::1``)."""
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host
