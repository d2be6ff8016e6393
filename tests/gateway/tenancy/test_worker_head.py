"""The request head a worker sees (``pipeline/worker_head.py``)."""

from __future__ import annotations

import pytest

from gpupool.gateway.errors import InvalidBody
from gpupool.gateway.pipeline.worker_head import worker_head

TP = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _names(head: bytes) -> list[bytes]:
    return [line.split(b":", 1)[0] for line in head.split(b"\r\n") if line]


def test_only_end_to_end_client_headers_pass_and_the_id_is_ours() -> None:
    head = worker_head([
        (b"connection", b"close, X-Named"), (b"x-named", b"1"), (b"upgrade", b"h2c"),
        (b"proxy-authorization", b"x"), (b"authorization", b"Bearer k"),
        (b"x-request-id", b"client"), (b"x-gpupool-anything", b"1"),
        (b"x-forwarded-proto", b"https"), (b"x-vllm-priority", b"-9"),
        (b"traceparent", TP), (b"user-agent", b"sdk/1"),
    ], b"ours")  # fmt: skip
    assert _names(head) == [b"traceparent", b"user-agent", b"content-type", b"x-request-id"]
    assert head.endswith(b"x-request-id: ours\r\n")


@pytest.mark.parametrize("tp", [b"00-zz", b"ff-" + TP[3:], TP + b"-extra", TP.upper()])
def test_a_bad_traceparent_goes_with_its_tracestate(tp: bytes) -> None:
    head = worker_head([(b"traceparent", tp), (b"tracestate", b"a=b")], b"id")
    assert b"trace" not in head


def test_an_oversized_tracestate_is_dropped() -> None:
    head = worker_head([(b"traceparent", TP), (b"tracestate", b"a" * 600)], b"id")
    assert b"tracestate" not in head and b"traceparent" in head


def test_a_line_break_in_a_value_is_refused() -> None:
    with pytest.raises(InvalidBody):
        worker_head([(b"x-a", b"1\r\nx-gpupool-tenant: t")], b"id")
