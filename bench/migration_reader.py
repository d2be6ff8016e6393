"""What the migration reader costs an event, with and without the token ids (docs/migration.md).

    .venv/bin/python bench/migration_reader.py

A stream that may move is read as it passes (``transform/continuation.Progress``: the text so
far, the ids every chunk carries); one that asked its worker for ``return_token_ids`` also keeps
the ids and takes them out of the client's bytes (``transform/token_ids.py``). Both are timed on
token events as vLLM 0.32 (CPU) writes them, one event a read, per event with warm caches. So
are the readers of ``/v1/messages`` and ``/v1/responses`` streams (``messages_continuation``,
``responses_continuation``), whose events passed untouched before they could move.
"""

from __future__ import annotations

import timeit

from gpupool.gateway.transform.continuation import Progress
from gpupool.gateway.transform.messages_continuation import MessagesProgress
from gpupool.gateway.transform.reframe import StreamProgress
from gpupool.gateway.transform.responses_continuation import ResponsesProgress
from gpupool.gateway.transform.token_ids import TokenIds

CHAT = (b'data: {"id":"chatcmpl-b229a05516e641d6","object":"chat.completion.chunk","created":'
        b'1796543094,"model":"tiny","choices":[{"index":0,"delta":{"content":"\\n"},"logprobs":'
        b'null,"finish_reason":null,"token_ids":%s}]}\n\n')  # fmt: skip
COMPLETION = (b'data: {"id":"cmpl-ac6c0c0b57b5f3cc","object":"text_completion","created":'
              b'1796543094,"model":"tiny","choices":[{"index":0,"text":" shch","logprobs":null,'
              b'"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":%s}]}'
              b"\n\n")  # fmt: skip
MESSAGES = (b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,"delta":'
            b'{"type":"text_delta","text":" shch"}}\n\n')  # fmt: skip
RESPONSES = (b'event: response.output_text.delta\ndata: {"content_index":0,"delta":" shch",'
             b'"item_id":"msg_9c3e0c2b1f6a4d7e8b5a0f1e2d3c4b5a","logprobs":[],"output_index":0,'
             b'"sequence_number":12,"type":"response.output_text.delta"}\n\n')  # fmt: skip
EVENTS = 2000


def _per_event(event: bytes, chat: bool, ids: bool) -> float:
    def run() -> None:
        p = Progress(chat)
        if ids:
            p.token_ids = TokenIds(1 << 20)
        for _ in range(EVENTS):
            p.feed(event)

    return min(timeit.repeat(run, number=5, repeat=7)) / 5 / EVENTS * 1e6


def _route_event(event: bytes, make: type[StreamProgress]) -> float:
    def run() -> None:
        p = make()
        if isinstance(p, ResponsesProgress):  # its delta counts on an open message item
            p.item = {"id": "msg", "output_index": 0, "content_index": 0, "texts": [],
                      "done": False, "part_done": False}  # fmt: skip
        for _ in range(EVENTS):
            p.feed(event)

    return min(timeit.repeat(run, number=5, repeat=7)) / 5 / EVENTS * 1e6


def main() -> None:
    for name, event, chat in (("chat", CHAT, True), ("completions", COMPLETION, False)):
        today = _per_event(event % b"null", chat, ids=False)
        with_ids = _per_event(event % b"[201]", chat, ids=True)
        print(f"{name}: reader {today:.2f} us/event; with token ids kept and stripped "
              f"{with_ids:.2f} us/event (+{with_ids - today:.2f})")  # fmt: skip
    for name, event, make in (("messages", MESSAGES, MessagesProgress),
                              ("responses", RESPONSES, ResponsesProgress)):  # fmt: skip
        print(f"{name}: reader {_route_event(event, make):.2f} us/event")


if __name__ == "__main__":
    main()
