"""The token ids a stream's worker generated: what a migration continues from, exactly.

A chat or completions stream that may move (``pipeline/migrate.py``) asks its worker for
``return_token_ids: true``. vLLM (0.32, ``chat_completion/serving.py``,
``completion/serving.py``) then writes, where it writes ``null`` without the flag::

    chat         the first (role) chunk     {…,"prompt_token_ids":[…],"prompt_text":null}
                 every token's choice       {…,"finish_reason":null,"token_ids":[…]}
    completions  a choice's first chunk     {…,"prompt_token_ids":[…],"token_ids":[…]}
                 every later one            {…,"prompt_token_ids":null,"token_ids":[…]}

and a chat stream gets a chunk for every engine step whose text vLLM holds back (a character
split over tokens), ``"delta":{}`` with the step's ids, which it does not send without the flag.

:class:`TokenIds` keeps the prompt's ids and choice 0's generated ids (bounded); :func:`strip`
gives the client the bytes vLLM writes without the flag: each list back to ``null`` and those
chat chunks dropped, at the byte level (a JSON string cannot hold an unescaped ``"``, so the
patterns cannot match inside a text). A client that asked for the ids itself gets them as
they came (its stream is not continued: ``transform/continuation.refusal``).
"""

from __future__ import annotations

from array import array
from typing import Any

Json = dict[str, Any]

FLAG = "return_token_ids"
_IDS = b'token_ids":['  # the end of both keys, "token_ids" and "prompt_token_ids"
_PROMPT = b'"prompt_'
_QUOTE = ord('"')
# a chat chunk vLLM sends only for the flag: no text, no finish, no logprobs (``serving.py``:
# a step whose delta is None is skipped unless ``return_token_ids``)
_FLAG_ONLY = b'"delta":{},"logprobs":null,"finish_reason":null,"token_ids":['
_INTS = b"0123456789,-"  # what a list of token ids is written with
_MAX_ID = 1 << 62  # a token id beyond any vocabulary (a worker that sends one is not trusted)


def strip(data: bytes) -> bytes:
    """Whole events of a stream as vLLM writes them without ``return_token_ids``. A list that
    is not written as vLLM writes ids (a lying worker's: nested, strings, floats) passes as it
    came, valid JSON; :class:`TokenIds` distrusts it."""
    at = data.find(_IDS)
    if at < 0:
        return data
    if _FLAG_ONLY in data and b"\r" not in data:
        data = b"".join(e + b"\n\n" for e in data.split(b"\n\n") if e and _FLAG_ONLY not in e)
        at = data.find(_IDS)
    parts: list[bytes] = []
    start = 0
    while at >= 0:
        key = at + len(_IDS) - 1  # the list's "["
        end = data.find(b"]", key)
        if (
            end < 0
            or not (data[at - 1] == _QUOTE or data.startswith(_PROMPT, at - len(_PROMPT)))
            or data[key + 1 : end].translate(None, _INTS)  # not a flat list of integers: a
        ):  # lying worker's (its ids distrusted), which a cut would leave invalid JSON
            at = data.find(_IDS, key)
            continue
        parts += (data[start:key], b"null")
        start = end + 1
        at = data.find(_IDS, start)
    parts.append(data[start:])
    return b"".join(parts)


def null_ids(obj: Json) -> None:
    """``obj`` (a chunk object) as vLLM writes it without the flag: its id lists ``null``."""
    if isinstance(obj.get("prompt_token_ids"), list):
        obj["prompt_token_ids"] = None
    choices = obj.get("choices")
    for choice in choices if isinstance(choices, list) else ():
        if isinstance(choice, dict):
            for key in ("prompt_token_ids", "token_ids"):
                if isinstance(choice.get(key), list):
                    choice[key] = None


class TokenIds:
    """The prompt's ids (the first worker's: a continuation's prompt is not the client's) and
    the ids generated for choice 0 so far, at most ``cap`` (the request's limit). ``usable``
    turns False for good when a chunk with text came without ids (a worker that does not
    return them, an older vLLM) or a worker sent more, or other, than a tokenizer's ids."""

    __slots__ = ("cap", "generated", "prompt", "spoiled")

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.prompt: array[int] | None = None
        self.generated: array[int] = array("q")
        self.spoiled = False

    @property
    def usable(self) -> bool:
        return not self.spoiled and self.prompt is not None

    def ids(self) -> list[int]:
        """The prompt the next worker reads: the prompt's ids and those generated."""
        assert self.prompt is not None
        return self.prompt.tolist() + self.generated.tolist()

    def read(self, obj: Json) -> None:
        """One chunk object as the worker sent it (before :func:`null_ids`)."""
        if self.spoiled:
            return
        choices = obj.get("choices")
        first = choices[0] if isinstance(choices, list) and choices else None
        choice = first if isinstance(first, dict) and first.get("index", 0) == 0 else None
        if self.prompt is None:
            self._prompt(obj, choice)
        if choice is not None:
            self._generated(choice)

    def _prompt(self, obj: Json, choice: Json | None) -> None:
        """The prompt's ids: chat's at the top of its first chunk, completions' in a choice."""
        prompt = obj.get("prompt_token_ids")
        if prompt is None and choice is not None:
            prompt = choice.get("prompt_token_ids")
        if prompt is not None:
            self.prompt = self._valid(prompt, 1 << 24)

    def _generated(self, choice: Json) -> None:
        ids = choice.get("token_ids")
        if ids is None or ids == []:  # text without its ids: they no longer cover the text
            if _has_text(choice):
                self.spoiled = True
            return
        if isinstance(ids, list) and len(ids) == 1:  # one engine step's token, the usual
            one = ids[0]
            if type(one) is int and 0 <= one < _MAX_ID and len(self.generated) < self.cap:
                self.generated.append(one)
                return
        got = self._valid(ids, self.cap - len(self.generated))
        if got is not None:
            self.generated.extend(got)

    def _valid(self, ids: object, room: int) -> array[int] | None:
        if (
            isinstance(ids, list)
            and len(ids) <= room
            and all(type(t) is int and 0 <= t < _MAX_ID for t in ids)
        ):
            return array("q", ids)
        self.spoiled = True
        return None


def _has_text(choice: Json) -> bool:
    delta = choice.get("delta")
    text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
    return isinstance(text, str) and bool(text)
