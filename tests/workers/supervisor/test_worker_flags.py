"""The vLLM flags and environment a launched worker gets from its model: reasoning and tool
parsers (so vLLM splits, and structured outputs compose with reasoning) and the gateway's media
policy as vLLM's own restrictions (defence in depth). ``launch.args``/``env`` always win."""

from __future__ import annotations

from typing import Any

import pytest

from gpupool.config.models import ModelConfig, WorkerConfig
from gpupool.workers.supervisor.command import (
    NO_MEDIA_DOMAIN,
    build_command,
    build_env,
    model_flags,
    worker_reasoning_parser,
)

TAIL = ["--host", "127.0.0.1", "--port", "8000", "--served-model-name", "m"]


def worker(args: dict[str, Any] | None = None, env: dict[str, str] | None = None) -> WorkerConfig:
    launch = {"model_path": "/m", "command": ["vllm", "serve", "{model_path}"],
              "args": args or {}, "env": env or {}}  # fmt: skip
    return WorkerConfig.model_validate({"name": "w", "model": "m", "launch": launch})


def model(**kw: Any) -> ModelConfig:
    return ModelConfig.model_validate({"name": "m", **kw})


def test_reasoning_model_gets_vllm_parser_and_tool_parser() -> None:
    m = model(reasoning="qwen3", tool_call_parser="hermes")
    assert build_command(worker({"dtype": "bfloat16"}), 8000, m) == [
        "vllm", "serve", "/m", "--dtype", "bfloat16",
        "--reasoning-parser", "qwen3",
        "--tool-call-parser", "hermes", "--enable-auto-tool-choice",
        *TAIL,
    ]  # fmt: skip
    assert worker_reasoning_parser(worker(), m) == "qwen3"


def test_plain_model_adds_nothing_and_no_model_keeps_the_old_command() -> None:
    assert build_command(worker(), 8000, model()) == ["vllm", "serve", "/m", *TAIL]
    assert build_command(worker(), 8000) == ["vllm", "serve", "/m", *TAIL]
    assert worker_reasoning_parser(worker(), model()) is None


@pytest.mark.parametrize(
    ("args", "argv", "parser"),
    [
        ({"reasoning-parser": False}, [], None),  # opt out: the gateway splits
        ({"reasoning_parser": None}, [], None),
        ({"--reasoning-parser": "deepseek_r1"}, ["--reasoning-parser", "deepseek_r1"],
         "deepseek_r1"),
    ],
)  # fmt: skip
def test_args_naming_the_reasoning_flag_win(
    args: dict[str, Any], argv: list[str], parser: str | None
) -> None:
    m = model(reasoning="qwen3")
    assert build_command(worker(args), 8000, m) == ["vllm", "serve", "/m", *argv, *TAIL]
    assert worker_reasoning_parser(worker(args), m) == parser


def test_args_naming_tool_flags_win() -> None:
    m = model(tool_call_parser="hermes")
    args = {"tool-call-parser": "qwen3_xml", "enable-auto-tool-choice": False}
    assert model_flags(worker(args), m) == []


def test_url_worker_has_no_worker_side_parser() -> None:
    url = WorkerConfig.model_validate({"name": "u", "model": "m", "url": "http://127.0.0.1:1"})
    assert worker_reasoning_parser(url, model(reasoning="qwen3")) is None


@pytest.mark.parametrize(
    ("policy", "domains", "flags"),
    [
        ("allow", [], []),
        ("deny", [], ["--allowed-media-domains", NO_MEDIA_DOMAIN]),
        ("allowlist", ["img.example.com", "cdn.example.org"],
         ["--allowed-media-domains", "img.example.com", "cdn.example.org"]),
        ("allowlist", [], ["--allowed-media-domains", NO_MEDIA_DOMAIN]),
    ],
)  # fmt: skip
def test_media_policy_becomes_vllm_allowed_domains(
    policy: str, domains: list[str], flags: list[str]
) -> None:
    m = model(remote_media=policy, remote_media_domains=domains)
    assert build_command(worker(), 8000, m) == ["vllm", "serve", "/m", *flags, *TAIL]


def test_media_domains_in_args_win() -> None:
    m = model(remote_media="deny")
    argv = build_command(worker({"allowed-media-domains": "mine.example"}), 8000, m)
    assert argv.count("--allowed-media-domains") == 1
    assert argv[argv.index("--allowed-media-domains") + 1] == "mine.example"


def test_worker_never_follows_media_redirects_unless_env_says() -> None:
    env = build_env(worker(), None, "/tmp/s", base={"VLLM_MEDIA_URL_ALLOW_REDIRECTS": "1"},
                    model=model())  # fmt: skip
    assert env["VLLM_MEDIA_URL_ALLOW_REDIRECTS"] == "0"
    mine = worker(env={"VLLM_MEDIA_URL_ALLOW_REDIRECTS": "1"})
    assert (
        build_env(mine, None, "/tmp/s", base={}, model=model())["VLLM_MEDIA_URL_ALLOW_REDIRECTS"]
        == "1"
    )
    assert "VLLM_MEDIA_URL_ALLOW_REDIRECTS" not in build_env(worker(), None, "/tmp/s", base={})


def test_workers_with_names_alike_publish_kv_events_on_their_own_sockets(tmp_path: Any) -> None:
    """Socket names are cut short (a Unix socket path's limit): two workers whose names share
    their first characters still get a socket each (a shared one would feed one worker's
    index the other's blocks)."""
    from gpupool.workers.supervisor.command import kv_events, kv_socket_dir

    def endpoints(name: str) -> tuple[str, str | None]:
        wc = WorkerConfig.model_validate({"name": name, "model": "m", "launch": {
            "model_path": "/m", "command": ["vllm", "serve", "{model_path}"]}})  # fmt: skip
        _argv, _env, src = kv_events(wc, [], {}, "0", kv_socket_dir(tmp_path))
        assert src is not None
        assert len(src.endpoint.removeprefix("ipc://")) <= 107
        return src.endpoint, src.replay

    names = ["llama-3.1-70b-instruct-gpu0", "llama-3.1-70b-instruct-gpu1", "w"]
    found = [endpoints(n) for n in names]
    assert len({pub for pub, _ in found}) == len(names)
    assert len({replay for _, replay in found}) == len(names)
