"""Multimodal checks: counts and vLLM's limit message, media policy, SSRF refusal."""

from __future__ import annotations

import asyncio
import base64
import socket
from typing import Any

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from gpupool.config.models import MediaLimits, ModelConfig, RemoteMediaPolicy
from gpupool.gateway.errors import BadRequest, MediaRejected
from gpupool.gateway.multimodal import (
    MediaCounts,
    base64_decoded_size,
    check_limits,
    check_media_policy,
    check_remote_hosts,
    count_media,
    extract_remote_urls,
    host_allowed,
)

Json = dict[str, Any]


def chat(*parts: Any, role: str = "user") -> Json:
    return {"model": "m", "messages": [{"role": role, "content": list(parts)}]}


def image(url: str) -> Json:
    return {"type": "image_url", "image_url": {"url": url}}


def data_uri(n_bytes: int, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(b"\x00" * n_bytes).decode()


def cfg(**kw: Any) -> ModelConfig:
    return ModelConfig(name="m", **kw)


# ---- counting ----------------------------------------------------------------------------


def test_counts_every_part_kind() -> None:
    body = chat(
        {"type": "text", "text": "hi"},
        image("https://a/x.png"),
        {"type": "input_image", "image_url": "https://a/y.png"},
        {"type": "image_pil", "image_pil": None},
        {"type": "image_embeds", "image_embeds": "AAAA"},
        {"type": "video_url", "video_url": {"url": "https://a/v.mp4"}},
        {"type": "video_embeds", "video_embeds": "AAAA"},
        {"type": "audio_url", "audio_url": {"url": "https://a/s.wav"}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
        {"type": "audio_embeds", "audio_embeds": "AAAA"},
        {"type": "thinking", "thinking": "…"},
    )
    assert count_media(body) == MediaCounts(image=4, video=2, audio=3)
    assert count_media(body).total == 9


def test_counts_across_messages_and_typeless_parts() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "plain text"},
            {"role": "user", "content": [image("https://a/1"), {"image_url": "https://a/2"}]},
            {"role": "assistant", "content": None},
            {
                "role": "user",
                "content": [{"video_url": {"url": "https://a/v"}}, {"input_audio": {}}],
            },
        ]
    }
    assert count_media(body) == MediaCounts(image=2, video=1, audio=1)


def test_counts_responses_input() -> None:
    body = {
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "x"}]},
            {"role": "user", "content": [{"type": "input_image", "image_url": "https://a/1"}]},
            {"type": "input_image", "image_url": "https://a/2"},
            "stray string",
        ]
    }
    assert count_media(body) == MediaCounts(image=2)
    assert count_media({"input": "just text"}) == MediaCounts()


@pytest.mark.parametrize(
    "body",
    [
        None,
        [],
        "text",
        {"messages": "nope"},
        {"messages": [1, "x", None, {"content": {"text": "image_url"}}]},
        {"messages": [{"content": [1, None, "image_url", ["image_url"]]}]},
        {"messages": [{"content": [{"type": 5, "image_url": {}}, {"type": None}]}]},
    ],
)
def test_counts_survive_hostile_shapes(body: Any) -> None:
    assert count_media(body) == MediaCounts()


def test_a_part_counts_wherever_it_nests() -> None:
    """Parts are found at any depth (a `tool_result`'s blocks, a content that is one part)."""
    nested = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "content": [
                            {
                                "type": "image",
                                "source": {"type": "url", "url": "https://example.com/a.png"},
                            }
                        ],
                    }
                ],
            }
        ]
    }
    assert count_media(nested) == MediaCounts(image=1)
    assert count_media({"messages": [{"content": {"type": "image_url"}}]}) == MediaCounts(image=1)


def test_counts_a_huge_list() -> None:
    body = chat(*([image("https://a/x")] * 50_000))
    assert count_media(body).image == 50_000


# ---- limits ------------------------------------------------------------------------------


def test_limit_message_is_vllms() -> None:
    with pytest.raises(MediaRejected) as info:
        check_limits(MediaCounts(image=3), MediaLimits(image=2))
    err = info.value
    assert err.message == "At most 2 image(s) may be provided in one prompt. (parameter=image)"
    assert err.param == "image" and err.status == 400
    assert err.type == "BadRequestError"


def test_limit_zero_and_other_modalities() -> None:
    with pytest.raises(MediaRejected, match=r"^At most 0 video\(s\) .*\(parameter=video\)$"):
        check_limits(MediaCounts(video=1), MediaLimits(image=5, video=0))
    with pytest.raises(MediaRejected, match="audio"):
        check_limits(MediaCounts(audio=2), MediaLimits(audio=1))


def test_limits_not_exceeded() -> None:
    check_limits(MediaCounts(image=2, video=9, audio=9), MediaLimits(image=2))
    check_limits(MediaCounts(image=100), None)


# ---- data URIs ---------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 100, 1001])
def test_base64_size_is_exact(n: int) -> None:
    encoded = base64.b64encode(b"x" * n).decode()
    assert base64_decoded_size(encoded) == n
    assert (
        base64_decoded_size("\n".join(encoded[i : i + 76] for i in range(0, len(encoded), 76))) == n
    )


@pytest.mark.parametrize(
    "payload", ["", "QQ", "QQ=", "Q===", "=QQ=", "QQ==QQ==", "QQ!=", "Q\u00e9==", "QQ =="]
)
def test_base64_malformed(payload: str) -> None:
    assert base64_decoded_size(payload) is None


def test_data_uri_at_the_limit_passes_and_one_more_byte_fails() -> None:
    model = cfg(max_media_bytes=1000)
    check_media_policy(chat(image(data_uri(1000))), model)
    with pytest.raises(MediaRejected) as info:
        check_media_policy(chat({"type": "text", "text": "x"}, image(data_uri(1001))), model)
    msg = info.value.message
    assert msg.startswith("messages[0].content[1].image_url.url: media is 1001 bytes")
    assert "limit of 1000 bytes" in msg


def test_oversize_message_does_not_echo_the_payload() -> None:
    with pytest.raises(MediaRejected) as info:
        check_media_policy(chat(image(data_uri(3_000_000))), cfg(max_media_bytes=1_000_000))
    assert len(info.value.message) < 200


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("data:image/png;base64", "malformed data URI"),
        ("data:" + "x" * 5000, "malformed data URI"),
        ("data:image/png,rawbytes", "only base64"),
        ("data:image/png;charset=utf-8;base64,QUJD", "only base64"),
        ("data:image/png;base64,", "malformed base64"),
        ("data:image/png;base64,QUJ", "malformed base64"),
        ("data:image/png;base64,QU*D", "malformed base64"),
    ],
)
def test_malformed_data_uris(url: str, problem: str) -> None:
    with pytest.raises(MediaRejected, match=problem) as info:
        check_media_policy(chat(image(url)), cfg())
    assert len(info.value.message) < 200


def test_input_audio_and_embeds_are_size_checked() -> None:
    model = cfg(max_media_bytes=10)
    big = base64.b64encode(b"\x00" * 11).decode()
    small = base64.b64encode(b"\x00" * 10).decode()
    check_media_policy(chat({"type": "input_audio", "input_audio": {"data": small}}), model)
    with pytest.raises(MediaRejected, match=r"input_audio\.data: media is 11 bytes"):
        check_media_policy(chat({"type": "input_audio", "input_audio": {"data": big}}), model)
    with pytest.raises(MediaRejected, match=r"image_embeds\.image_grid_thw"):
        check_media_policy(
            chat({"image_embeds": {"image_embeds": small, "image_grid_thw": big}}), model
        )
    with pytest.raises(MediaRejected, match="malformed base64"):
        check_media_policy(
            chat({"type": "input_audio", "input_audio": {"data": "not base64!"}}), model
        )


# ---- URL schemes and remote policy ---------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    ["file:///etc/passwd", "FILE:///etc/passwd", "  file:///etc/passwd", "fi\tle:///etc/passwd"],
)
def test_file_urls_always_refused(url: str) -> None:
    with pytest.raises(MediaRejected, match="file:// URLs are not accepted"):
        check_media_policy(chat(image(url)), cfg(remote_media=RemoteMediaPolicy.allow))


@pytest.mark.parametrize(
    "url", ["ftp://a/x.png", "gopher://a/", "x.png", "//host/x.png", "/etc/passwd", ""]
)
def test_other_schemes_refused(url: str) -> None:
    with pytest.raises(MediaRejected, match="unsupported media URL"):
        check_media_policy(chat(image(url)), cfg())


def test_refusal_truncates_long_urls() -> None:
    with pytest.raises(MediaRejected) as info:
        check_media_policy(chat(image("ftp://host/" + "a" * 1_000_000)), cfg())
    assert len(info.value.message) < 200 and "…" in info.value.message


def test_deny_policy_refuses_http() -> None:
    with pytest.raises(MediaRejected, match="remote media URLs are not allowed"):
        check_media_policy(
            chat(image("https://example.com/a.png")), cfg(remote_media=RemoteMediaPolicy.deny)
        )
    check_media_policy(chat(image(data_uri(3))), cfg(remote_media=RemoteMediaPolicy.deny))


@pytest.mark.parametrize(
    ("url", "ok"),
    [
        ("https://example.com/a.png", True),
        ("https://img.example.com/a.png", True),
        ("https://a.b.EXAMPLE.com./a.png", True),
        ("http://example.com:8080/a.png", True),
        ("https://evilexample.com/a.png", False),
        ("https://example.com.evil.net/a.png", False),
        ("https://cdn.test/a.png", True),
        ("https://sub.cdn.test/a.png", True),
        ("https://other.org/a.png", False),
    ],
)
def test_allowlist(url: str, ok: bool) -> None:
    model = cfg(
        remote_media=RemoteMediaPolicy.allowlist, remote_media_domains=["example.com", "*.cdn.test"]
    )
    if ok:
        check_media_policy(chat(image(url)), model)
    else:
        with pytest.raises(MediaRejected, match="not in this model's media allowlist"):
            check_media_policy(chat(image(url)), model)


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("https://example.com@evil.com/a.png", "credentials"),
        ("https://user:pw@example.com/a.png", "credentials"),
        ("https://evil.com\\@example.com/a.png", "backslashes"),
        ("https://example.com/a b.png", "spaces"),
        ("https://exa\nmple.com/a.png", "control characters"),
        ("https://[::1/a.png", "malformed URL"),
        ("https:///a.png", "no valid host"),
        ("https://%65xample.com/a.png", "no valid host"),
        ("https://ex\u0430mple.com/a.png", "xn-- form"),
        ("https://example.com/" + "a" * 9000, "longer than 8192"),
    ],
)
def test_ambiguous_urls_refused(url: str, problem: str) -> None:
    model = cfg(remote_media=RemoteMediaPolicy.allowlist, remote_media_domains=["example.com"])
    with pytest.raises(MediaRejected, match=problem) as info:
        check_media_policy(chat(image(url)), model)
    assert len(info.value.message) < 250


def test_host_allowed_edge_cases() -> None:
    assert host_allowed("example.com", [" Example.COM. "])
    assert not host_allowed("example.com", [""])
    assert not host_allowed("com", ["example.com"])
    assert host_allowed("::1", ["[::1]"])


def test_extract_remote_urls() -> None:
    body = chat(
        image("https://a.test/1.png"),
        image(data_uri(3)),
        {"type": "video_url", "video_url": {"url": "http://b.test/v.mp4"}},
        image("https://a.test/1.png"),
        {"type": "input_audio", "input_audio": {"data": "QUJD"}},
    )
    assert extract_remote_urls(body) == ["https://a.test/1.png", "http://b.test/v.mp4"]


# ---- SSRF --------------------------------------------------------------------------------


def resolver_for(table: dict[str, list[str]]) -> Any:
    async def resolve(host: str) -> list[str]:
        if host not in table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return table[host]

    return resolve


async def test_public_hosts_pass() -> None:
    resolve = resolver_for({"img.test": ["93.184.216.34", "2606:2800:220:1:248:1893:25c8:1946"]})
    await check_remote_hosts(["https://img.test/a.png", "https://img.test/b.png"], resolve)
    await check_remote_hosts([], resolve)


@pytest.mark.parametrize(
    ("address", "reason"),
    [
        ("127.0.0.1", "loopback"),
        ("::1", "loopback"),
        ("10.1.2.3", "private"),
        ("172.16.0.1", "private"),
        ("192.168.1.1", "private"),
        ("fc00::1", "private"),
        ("169.254.169.254", "cloud metadata"),
        ("fd00:ec2::254", "cloud metadata"),
        ("168.63.129.16", "cloud metadata"),
        ("169.254.1.1", "link-local"),
        ("fe80::1", "link-local"),
        ("fe80::1%eth0", "link-local"),
        ("224.0.0.1", "multicast"),
        ("ff02::1", "multicast"),
        ("0.0.0.0", "unspecified"),
        ("::", "unspecified"),
        ("240.0.0.1", "reserved"),
        ("100.64.0.1", "not a public address"),
        ("::ffff:127.0.0.1", "loopback"),
        ("::ffff:169.254.169.254", "cloud metadata"),
        ("64:ff9b::a00:1", "private"),
        ("2002:7f00:1::", "loopback"),
    ],
)
async def test_non_public_addresses_refused(address: str, reason: str) -> None:
    resolve = resolver_for({"evil.test": ["93.184.216.34", address]})
    with pytest.raises(MediaRejected, match=f"media host 'evil.test' is .*{reason}"):
        await check_remote_hosts(["https://evil.test/a.png"], resolve)


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1/x",
        "http://[::1]/x",
        "http://[::ffff:7f00:1]/x",
        "http://127.1/x",
        "http://2130706433/x",
        "http://0x7f000001/x",
        "http://0177.0.0.1/x",
        "http://169.254.169.254/latest/meta-data/",
        "http://[fd00:ec2::254]/",
        "http://10.0.0.1./x",
    ],
)
async def test_literal_ips_refused_without_dns(url: str) -> None:
    async def must_not_resolve(host: str) -> list[str]:
        raise AssertionError(f"resolved {host}")

    with pytest.raises(MediaRejected, match="only public hosts are allowed"):
        await check_remote_hosts([url], must_not_resolve)


async def test_unresolvable_and_odd_answers_refused() -> None:
    resolve = resolver_for({"empty.test": [], "junk.test": ["not-an-ip"]})
    for host in ("missing.test", "empty.test", "junk.test"):
        with pytest.raises(MediaRejected, match=f"could not resolve media host '{host}'"):
            await check_remote_hosts([f"https://{host}/a"], resolve)


async def test_resolution_timeout_refused() -> None:
    async def slow(host: str) -> list[str]:
        await asyncio.sleep(10)
        return ["93.184.216.34"]

    with pytest.raises(MediaRejected, match="timed out"):
        await check_remote_hosts(["https://slow.test/a"], slow, timeout_s=0.05)


async def test_system_resolver_refuses_localhost() -> None:
    with pytest.raises(MediaRejected, match="loopback"):
        await check_remote_hosts(["http://localhost:8000/x.png"])


async def test_bad_url_in_host_check_is_a_media_error() -> None:
    with pytest.raises(MediaRejected, match="credentials"):
        await check_remote_hosts(["http://a@b.test/"], resolver_for({}))


# ---- never anything but a 400 --------------------------------------------------------------

KEYS = [
    "messages", "input", "content", "type", "url", "data", "image_url", "input_image", "video_url",
    "audio_url", "input_audio", "image_embeds", "audio_embeds", "video_embeds", "image_pil", "role",
]  # fmt: skip
STRINGS = [
    "image_url", "input_image", "video_url", "input_audio", "image_embeds", "text",
    "data:image/png;base64,QUJD", "data:", "data:,", "data:;base64,", "data:a;base64,QQ",
    "file:///etc/passwd", "https://example.com/a.png", "http://[::1", "http://a@b/", "http://%41/",
    "https://\u00e9.com/", "ftp://x", "QUJD", "", ":", "\x00", "data:image/png;base64,\u00e9",
]  # fmt: skip
leaves = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.sampled_from(STRINGS)
    | st.text(max_size=8)
)
json_values = st.recursive(
    leaves,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=3), inner, max_size=4)
    ),
    max_leaves=25,
)
media_types = st.sampled_from(
    ["image_url", "input_image", "video_url", "audio_url", "input_audio", "image_embeds"]
)
media_values = (
    st.sampled_from(STRINGS)
    | st.fixed_dictionaries({"url": st.sampled_from(STRINGS) | leaves})
    | st.fixed_dictionaries({"data": st.sampled_from(STRINGS) | leaves})
    | json_values
)
media_parts = st.builds(
    lambda t, v, typed: {"type": t, t: v} if typed else {t: v},
    media_types,
    media_values,
    st.booleans(),
)
parts = media_parts | st.dictionaries(st.sampled_from(KEYS), json_values, max_size=3) | json_values
contents = st.lists(parts, max_size=4) | json_values
messages = st.lists(
    st.fixed_dictionaries({"role": leaves, "content": contents}) | json_values, max_size=3
)
bodies = st.one_of(
    st.fixed_dictionaries({"messages": messages}),
    st.fixed_dictionaries(
        {"input": st.lists(parts | st.fixed_dictionaries({"content": contents}), max_size=3)}
    ),
    st.dictionaries(st.sampled_from(["messages", "input", "model"]), json_values, max_size=3),
    json_values,
)
MODELS = [
    cfg(max_media_bytes=2),
    cfg(remote_media=RemoteMediaPolicy.deny),
    cfg(remote_media=RemoteMediaPolicy.allowlist, remote_media_domains=["example.com"]),
]


@settings(max_examples=300, deadline=None)
@given(body=bodies, model=st.sampled_from(MODELS))
def test_hostile_json_only_ever_raises_bad_request(body: Any, model: ModelConfig) -> None:
    counts = count_media(body)
    assert min(counts.image, counts.video, counts.audio) >= 0
    try:
        check_media_policy(body, model)
        event("accepted")
    except BadRequest:
        event("refused")
    for url in extract_remote_urls(body):
        assert url.lower().lstrip().startswith("http")
