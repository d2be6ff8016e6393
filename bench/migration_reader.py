"""What the migration reader costs an event, with and without the token ids (docs/migration.md).

    .venv/bin/python bench/migration_reader.py

A stream that may move is read as it passes (``transform/continuation.Progress``: the text so
far, the ids every chunk carries); one that asked its worker for ``return_token_ids`` also keeps
the ids and takes them out of the client's bytes (``transform/token_ids.py``). Both are timed on
token events as vLLM 0.32 (CPU) writes them, one event a read, per event with warm caches.
"""

from __future__ import annotations

import timeit

from gpupool.gateway.transform.continuation import Progress
from gpupool.gateway.transform.token_ids import TokenIds

CHAT = (b'data: {"id":"chatcmpl-b229a05516e641d6","object":"chat.completion.chunk","created":'
        b'1796543094,"model":"tiny","choices":[{"index":0,"delta":{"content":"\\n"},"logprobs":'
        b'null,"finish_reason":null,"token_ids":%s}]}\n\n')  # fmt: skip
COMPLETION = (b'data: {"id":"cmpl-ac6c0c0b57b5f3cc","object":"text_completion","created":'
              b'1796543094,"model":"tiny","choices":[{"index":0,"text":" shch","logprobs":null,'
              b'"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":%s}]}'
              b"\n\n")  # fmt: skip
EVENTS = 2000


def _per_event(event: bytes, chat: bool, ids: bool) -> float:
    def run() -> None:
        p = Progress(chat)
        if ids:
            p.token_ids = TokenIds(1 << 20)
        for _ in range(EVENTS):
            p.feed(event)

    return min(timeit.repeat(run, number=5, repeat=7)) / 5 / EVENTS * 1e6


def main() -> None:
    for name, event, chat in (("chat", CHAT, True), ("completions", COMPLETION, False)):
        today = _per_event(event % b"null", chat, ids=False)
        with_ids = _per_event(event % b"[201]", chat, ids=True)
        print(f"{name}: reader {today:.2f} us/event; with token ids kept and stripped "
              f"{with_ids:.2f} us/event (+{with_ids - today:.2f})")  # fmt: skip


if __name__ == "__main__":
    main()
