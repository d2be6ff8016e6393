"""Multimodal checks made before a request reaches a worker.

Every check walks the whole of a body's content at any depth (:func:`iter_nodes`), on every
route: a source nested in an Anthropic ``tool_result`` or ``system`` block, a ``document``,
a Responses ``input_file`` or a score/rerank input is checked as a top-level image is.

* :func:`count_media` + :func:`check_limits`: vLLM's ``--limit-mm-per-prompt`` (§3), with
  vLLM's exact message, so a request that would fail on the worker fails the same way here.
* :func:`check_media_policy`: ``data:`` URIs (size, shape), ``file://`` (always refused) and
  http(s) URLs per the model's ``remote_media`` policy.
* :func:`extract_remote_urls` + :func:`check_remote_hosts`: when remote media is allowed, the
  hosts must not resolve to loopback, private, link-local, metadata or other non-public
  addresses (SSRF). This is the only network I/O here (DNS), and the resolver is injectable.

Every refusal is a :class:`~gpupool.gateway.errors.MediaRejected` (400) whose message names the
part (``messages[0].content[1].image_url``) and never echoes more than a short prefix of a URL.
Hostile shapes (content not a list, parts not dicts) are skipped, never crash: schema errors
are the worker's to report.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from gpupool.config.models import MediaLimits, ModelConfig, RemoteMediaPolicy
from gpupool.gateway.errors import MediaRejected

KIND_BY_PART_TYPE: Mapping[str, str] = {
    "image_url": "image",
    "input_image": "image",
    "image": "image",  # Anthropic Messages: {"type": "image", "source": {...}}
    "image_pil": "image",
    "image_embeds": "image",
    "video_url": "video",
    "video_embeds": "video",
    "audio_url": "audio",
    "input_audio": "audio",
    "audio_embeds": "audio",
}
MODALITIES = ("image", "video", "audio")
MAX_URL_CHARS = 8192  # longer http(s) URLs are refused; media that large belongs in a data: URI
_SHORT = 80
_B64_ALPHABET = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
_B64_IGNORED = b"\t\r\n"  # urllib (and so vLLM) removes these from URLs before decoding
_C0_OR_SPACE = "".join(chr(c) for c in range(0x21))
_METADATA_IPS = frozenset(
    ipaddress.ip_address(a) for a in ("169.254.169.254", "fd00:ec2::254", "168.63.129.16")
)
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")

# Fields of a body that never reach a worker's media loader: tool and output definitions and
# settings (a URL there is data, not media), and the arguments of a model's own tool call.
_NOT_CONTENT = frozenset(
    {"tools", "tool_choice", "functions", "response_format", "structured_outputs",
     "guided_json", "text", "metadata", "chat_template_kwargs", "mm_processor_kwargs",
     "vllm_xargs", "kv_transfer_params", "logit_bias", "reasoning", "thinking",
     "stream_options", "prompt_embeds"}
)  # fmt: skip
_ARGUMENT_BLOCKS = frozenset({"tool_use", "server_tool_use", "mcp_tool_use", "function_call"})

_KIND_KEYS = frozenset(KIND_BY_PART_TYPE)
_SOURCE_KEYS = frozenset(
    {"image_url", "video_url", "audio_url", "input_audio", "image_embeds", "video_embeds",
     "audio_embeds", "file_url", "file_data", "source"}
)  # fmt: skip

Resolver = Callable[[str], Awaitable[Iterable[str]]]
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True, slots=True)
class MediaCounts:
    image: int = 0
    video: int = 0
    audio: int = 0

    @property
    def total(self) -> int:
        return self.image + self.video + self.audio


@dataclass(frozen=True, slots=True)
class MediaSource:
    """One URL or base64 payload found in a request: where it is, and what it is."""

    where: str
    value: str
    is_url: bool  # False: raw base64 (input_audio.data, *_embeds)


# ---- walking the request -------------------------------------------------------------------


def may_hold_media(raw: bytes) -> bool:
    """Whether a body may hold a media part or a source at all (``\\u``: a JSON-escaped
    spelling of one of these words); without one the checks are skipped."""
    return (
        b"url" in raw
        or b"image" in raw
        or b"video" in raw
        or b"audio" in raw
        or b"source" in raw
        or b"file" in raw
        or b"\\u" in raw
    )


Loc = tuple[Any, str | int] | None  # (parent's Loc, key or index): a path, built on demand
_CONTAINERS = (dict, list)


def where(loc: Loc) -> str:
    """``messages[0].content[1]`` for a node's :data:`Loc`."""
    keys: list[str | int] = []
    while loc is not None:
        loc, key = loc
        keys.append(key)
    out = ""
    for key in reversed(keys):
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else key)
    return out


def iter_nodes(body: object) -> Iterator[tuple[Loc, dict[str, Any]]]:
    """(location, object) for every JSON object of a body's content, at any depth, in order.

    Every route's content goes through here, whatever nests it: chat and Anthropic
    ``messages`` (a ``tool_result``'s blocks, a ``document``'s ``content`` source), Anthropic
    ``system`` blocks, Responses ``input`` (items, their ``content``, a
    ``function_call_output``'s ``output``), embedding, score and rerank inputs. Only the
    fields that never reach a worker's media loader are left out (``_NOT_CONTENT``: tool and
    output definitions, settings; the arguments of a model's own tool call). A location is a
    chain of tuples (:func:`where` spells it): no string is made for a node that passes.
    """
    if not isinstance(body, dict):
        return
    stack: list[tuple[Loc, object]] = [
        ((None, k), v) for k, v in reversed(body.items())
        if k not in _NOT_CONTENT and isinstance(v, _CONTAINERS)
    ]  # fmt: skip
    pop, push = stack.pop, stack.extend
    while stack:
        loc, node = pop()
        if isinstance(node, dict):
            yield loc, node
            kind = node.get("type")
            if isinstance(kind, str) and kind in _ARGUMENT_BLOCKS:
                push(reversed([((loc, k), v) for k, v in node.items()
                               if k != "input" and isinstance(v, _CONTAINERS)]))  # fmt: skip
            else:
                push(reversed([((loc, k), v) for k, v in node.items()
                               if isinstance(v, _CONTAINERS)]))  # fmt: skip
        elif isinstance(node, list):
            push(reversed([((loc, i), v) for i, v in enumerate(node)
                           if isinstance(v, _CONTAINERS)]))  # fmt: skip


@dataclass(frozen=True, slots=True)
class Scan:
    """A body's media, from one walk: its parts counted, and every source to check."""

    counts: MediaCounts
    sources: list[MediaSource]

    def remote_urls(self) -> list[str]:
        """http(s) media URLs, in order, without duplicates."""
        urls = (s.value for s in self.sources if s.is_url)
        return list(dict.fromkeys(u for u in urls if _scheme(u) in ("http", "https")))


def scan(body: object) -> Scan:
    """Count a body's media parts and collect its sources in one walk (:func:`iter_nodes`)."""
    counts = dict.fromkeys(MODALITIES, 0)
    sources = list(_listed_images(body))
    for loc, node in iter_nodes(body):
        kind = part_kind(node)
        if kind is not None:
            counts[kind] += 1
        if not _SOURCE_KEYS.isdisjoint(node):
            sources.extend(_part_sources(where(loc), node))
    return Scan(MediaCounts(**counts), sources)


def iter_parts(body: object) -> Iterator[tuple[str, dict[str, Any]]]:
    """(location, part) for every media part of a body, at any depth (:func:`iter_nodes`)."""
    for loc, node in iter_nodes(body):
        if part_kind(node) is not None:
            yield where(loc), node


def part_kind(part: Mapping[str, Any]) -> str | None:
    """``image``/``video``/``audio`` for a media part, None otherwise.

    A part without ``type`` is recognised by its key, as vLLM does for ``{"image_url": …}``.
    """
    part_type = part.get("type")
    if isinstance(part_type, str):
        return KIND_BY_PART_TYPE.get(part_type)
    if part_type is None and not _KIND_KEYS.isdisjoint(part):
        for key, kind in KIND_BY_PART_TYPE.items():
            if part.get(key) is not None:
                return kind
    return None


def count_media(body: object) -> MediaCounts:
    return scan(body).counts


def check_limits(counts: MediaCounts, limits: MediaLimits | None) -> None:
    if limits is None:
        return
    for kind in MODALITIES:
        limit: int | None = getattr(limits, kind)
        if limit is not None and getattr(counts, kind) > limit:
            raise MediaRejected(
                f"At most {limit} {kind}(s) may be provided in one prompt. (parameter={kind})",
                param=kind,
            )


def iter_sources(body: object) -> Iterator[MediaSource]:
    """Every URL or base64 payload a worker may load, wherever it nests."""
    yield from scan(body).sources


def _listed_images(body: object) -> Iterator[MediaSource]:
    """Cohere's /v2/embed: ``images``, a list of URLs or data URIs."""
    images = body.get("images") if isinstance(body, dict) else None
    if isinstance(images, list):
        for i, url in enumerate(images):
            if isinstance(url, str):
                yield MediaSource(f"images[{i}]", url, True)


def _part_sources(where: str, part: Mapping[str, Any]) -> Iterator[MediaSource]:
    for key in ("image_url", "video_url", "audio_url"):
        value = part.get(key)  # {"url": …}, or a bare string (Responses, vLLM's simple form)
        if isinstance(value, dict) and isinstance(value.get("url"), str):
            yield MediaSource(f"{where}.{key}.url", value["url"], True)
        elif isinstance(value, str):
            yield MediaSource(f"{where}.{key}", value, True)
    audio = part.get("input_audio")
    if isinstance(audio, dict) and isinstance(audio.get("data"), str):
        data: str = audio["data"]
        yield MediaSource(f"{where}.input_audio.data", data, _scheme(data) == "data")
    for key in ("image_embeds", "video_embeds", "audio_embeds"):
        yield from _embeds(f"{where}.{key}", part.get(key))
    yield from _file_and_source(where, part)


def _file_and_source(where: str, part: Mapping[str, Any]) -> Iterator[MediaSource]:
    for key in ("file_url", "file_data"):  # Responses `input_file`, chat's `file`
        value = part.get(key)
        if isinstance(value, str):
            url = key == "file_url" or _scheme(value) == "data"
            yield MediaSource(f"{where}.{key}", value, url)
    source = part.get("source")  # Anthropic Messages (image, document): a URL or base64 data
    if isinstance(source, dict):
        if source.get("type") == "url" and isinstance(source.get("url"), str):
            yield MediaSource(f"{where}.source.url", source["url"], True)
        elif source.get("type") == "base64" and isinstance(source.get("data"), str):
            yield MediaSource(f"{where}.source.data", source["data"], False)


def _embeds(where: str, value: object) -> Iterator[MediaSource]:
    if isinstance(value, str):
        yield MediaSource(where, value, False)
    elif isinstance(value, dict):
        for name, item in value.items():
            if isinstance(item, str):
                yield MediaSource(f"{where}.{name}", item, False)


# ---- policy --------------------------------------------------------------------------------


def check_media_policy(body: object | Scan, model_cfg: ModelConfig) -> None:
    for source in (body if isinstance(body, Scan) else scan(body)).sources:
        if not source.is_url:
            _check_base64(source.where, source.value, model_cfg.max_media_bytes)
        else:
            _check_url(source, model_cfg)


def extract_remote_urls(body: object) -> list[str]:
    """http(s) media URLs in the request, in order, without duplicates."""
    return scan(body).remote_urls()


def _check_url(source: MediaSource, cfg: ModelConfig) -> None:
    where, url = source.where, source.value
    scheme = _scheme(url)
    if scheme == "data":
        _check_data_uri(where, url, cfg.max_media_bytes)
    elif scheme in ("http", "https"):
        _check_remote_url(where, url, cfg)
    elif scheme == "file":
        raise MediaRejected(f"{where}: file:// URLs are not accepted; send a data: URI instead")
    else:
        raise MediaRejected(
            f"{where}: unsupported media URL {_short(url)!r}; use an http(s) URL or a data: URI"
        )


def _scheme(url: str) -> str:
    """The scheme as ``urllib.parse.urlsplit`` (and so vLLM) sees it, from a short prefix."""
    head = url[:64].lstrip(_C0_OR_SPACE).replace("\t", "").replace("\r", "").replace("\n", "")
    colon = head.find(":")
    if colon <= 0 or not (head[0].isascii() and head[0].isalpha()):
        return ""
    scheme = head[:colon]
    if not all(c.isascii() and (c.isalnum() or c in "+-.") for c in scheme):
        return ""
    return scheme.lower()


def _check_data_uri(where: str, url: str, limit: int) -> None:
    start = url.find(":") + 1
    comma = url.find(",", start, start + 256)
    if comma == -1:
        raise MediaRejected(f"{where}: malformed data URI (expected data:<type>;base64,<data>)")
    _, sep, encoding = url[start:comma].partition(";")
    if not sep or encoding != "base64":
        raise MediaRejected(f"{where}: only base64 data URIs are supported (data:<type>;base64,…)")
    _check_base64(where, url[comma + 1 :], limit)


def _check_base64(where: str, payload: str, limit: int) -> None:
    size = base64_decoded_size(payload)
    if size is None:
        raise MediaRejected(f"{where}: malformed base64 media data")
    if size > limit:
        raise MediaRejected(
            f"{where}: media is {size} bytes after decoding, over this model's "
            f"limit of {limit} bytes"
        )


def base64_decoded_size(payload: str) -> int | None:
    """Exact decoded size of a base64 payload without decoding it; None when malformed.

    Two C-speed passes (``bytes.translate``); tabs and newlines are ignored as urllib ignores
    them; padding is required, as Python's decoders require it.
    """
    if not payload or not payload.isascii():
        return None
    data = payload.encode("ascii").translate(None, _B64_IGNORED)
    rest = data.translate(None, _B64_ALPHABET)  # what is left must be the padding
    letters = len(data) - len(rest)
    if rest not in (b"", b"=", b"==") or not data.endswith(rest):
        return None
    if letters == 0 or len(data) % 4:
        return None
    return letters * 3 // 4


def _check_remote_url(where: str, url: str, cfg: ModelConfig) -> None:
    if cfg.remote_media is RemoteMediaPolicy.deny:
        raise MediaRejected(
            f"{where}: remote media URLs are not allowed for this model; "
            "send the media inline as a data: URI"
        )
    host = url_host(where, url)
    if cfg.remote_media is RemoteMediaPolicy.allowlist and not host_allowed(
        host, cfg.remote_media_domains
    ):
        raise MediaRejected(f"{where}: host {host!r} is not in this model's media allowlist")


def url_host(where: str, url: str) -> str:
    """The host of an http(s) URL, refusing shapes that parsers disagree on."""
    if len(url) > MAX_URL_CHARS:
        raise MediaRejected(f"{where}: URL is longer than {MAX_URL_CHARS} characters")
    if "\\" in url or any(c in _C0_OR_SPACE or c == "\x7f" for c in url):
        raise MediaRejected(
            f"{where}: URL {_short(url)!r} contains spaces, control characters or backslashes"
        )
    try:
        parts = urlsplit(url)
        host = parts.hostname
    except ValueError:
        raise MediaRejected(f"{where}: malformed URL {_short(url)!r}") from None
    if "@" in parts.netloc:
        raise MediaRejected(f"{where}: URLs with credentials are not accepted")
    if not host or "%" in host:
        raise MediaRejected(f"{where}: URL {_short(url)!r} has no valid host")
    if not host.isascii():
        raise MediaRejected(f"{where}: write the host of {_short(url)!r} in its xn-- form")
    return host.rstrip(".")


def host_allowed(host: str, domains: Iterable[str]) -> bool:
    """``host`` equals an entry or is a subdomain of one (``a.example.com`` ∈ ``example.com``)."""
    host = host.lower().rstrip(".")
    for entry in domains:
        domain = entry.strip().lower().removeprefix("*.").strip(".").strip("[]")
        if domain and (host == domain or host.endswith("." + domain)):
            return True
    return False


def _short(url: str) -> str:
    """A prefix of ``url`` safe to echo: never a data payload, never more than a line."""
    if _scheme(url) == "data":
        comma = url.find(",", 0, 64)
        return (url[: comma + 1] if comma != -1 else url[:32]) + "…"
    return url if len(url) <= _SHORT else url[:_SHORT] + "…"


# ---- SSRF ----------------------------------------------------------------------------------


async def check_remote_hosts(
    urls: list[str], resolver: Resolver | None = None, *, timeout_s: float = 5.0
) -> None:
    """Refuse URLs whose host is, or resolves to, a non-public address.

    The worker resolves the name again when it fetches, so a rebinding DNS server can still
    race this check; it stops the plain cases (``http://localhost``, ``http://10.0.0.1``,
    names pointing at metadata services).
    """
    hosts = dict.fromkeys(url_host("media URL", u) for u in urls)
    resolve = resolver or system_resolver
    try:
        async with asyncio.timeout(timeout_s):
            await asyncio.gather(*(_check_host(h, resolve) for h in hosts))
    except TimeoutError:
        raise MediaRejected("timed out resolving the host of a media URL") from None


async def system_resolver(host: str) -> list[str]:
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


async def _check_host(host: str, resolve: Resolver) -> None:
    literal = literal_ip(host)
    if literal is not None:
        addresses: list[IPAddress] = [literal]
    else:
        try:
            found = list(await resolve(host))
        except (OSError, ValueError):  # gaierror; UnicodeError from the idna codec
            raise MediaRejected(f"could not resolve media host {host!r}") from None
        addresses = [a for a in (literal_ip(s) for s in found) if a is not None]
        if not addresses or len(addresses) != len(found):
            raise MediaRejected(f"could not resolve media host {host!r}")
    for address in addresses:
        reason = blocked_reason(address)
        if reason is not None:
            raise MediaRejected(f"media host {host!r} is {reason}; only public hosts are allowed")


def literal_ip(host: str) -> IPAddress | None:
    """``host`` as an IP address, including the legacy IPv4 forms (``127.1``, ``0x7f000001``)."""
    host = host.strip("[]")
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    if not host or not host[0].isdigit():
        return None
    try:
        return ipaddress.IPv4Address(socket.inet_aton(host))
    except (OSError, ValueError):
        return None


def blocked_reason(address: IPAddress) -> str | None:
    """Why a worker must not fetch from ``address``, or None for a public address."""
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:  # ::ffff:a.b.c.d is a.b.c.d to the kernel
            return blocked_reason(address.ipv4_mapped)
        embedded = _embedded_ipv4(address)
        if embedded is not None and (reason := blocked_reason(embedded)) is not None:
            return reason
    if address in _METADATA_IPS:
        return "a cloud metadata address"
    checks = (
        (address.is_loopback, "a loopback address"),
        (address.is_link_local, "a link-local address"),
        (address.is_multicast, "a multicast address"),
        (address.is_unspecified, "an unspecified address"),
        (address.is_reserved, "a reserved address"),
        (address.is_private, "a private address"),
        (not address.is_global, "not a public address"),
    )
    return next((reason for hit, reason in checks if hit), None)


def _embedded_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if address.sixtofour is not None:
        return address.sixtofour
    if address.teredo is not None:
        return address.teredo[1]
    if address in _NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None
