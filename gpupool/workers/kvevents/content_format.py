"""Which form of message content a chat template gets from vLLM: ``"string"`` or ``"openai"``.

vLLM (``--chat-template-content-format auto``, its default) reads the template's syntax tree
once and hands every message's content as a list of parts (``[{"type": "text", "text": ...}]``)
when the template loops over a message's content, else as one string (text parts joined with
``"\\n"``). This is vLLM 0.32's ``_detect_content_format`` and its helpers
(``vllm/renderers/hf.py``), ported so that a prompt is rendered once, in the form vLLM will
render it. A template that cannot be parsed is ``"string"``, as there.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Literal

import jinja2
import jinja2.nodes as nodes

ContentFormat = Literal["string", "openai"]


def detect(env: jinja2.Environment, source: str) -> ContentFormat:
    """The form vLLM gives ``source``'s messages (``env``: transformers' environment)."""
    try:
        tree = env.parse(source)
    except Exception:  # vLLM logs the template's error and takes its default
        return "string"
    try:
        next(_content_loops(tree))
    except Exception:  # StopIteration (no such loop), or vLLM's default on an odd tree
        return "string"
    return "openai"


def _is_var(node: nodes.Node, name: str) -> bool:
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name


def _is_attr(node: nodes.Node, name: str, key: str) -> bool:
    if isinstance(node, nodes.Getitem):
        arg = node.arg
        return _is_var(node.node, name) and isinstance(arg, nodes.Const) and arg.value == key
    if isinstance(node, nodes.Getattr):
        return _is_var(node.node, name) and node.attr == key
    return False


def _is_var_or_elems(node: nodes.Node, name: str, key: str | None = None) -> bool:
    """``name`` (or ``name[key]``, ``name.key``), through filters, tests and slices."""
    if isinstance(node, nodes.Filter):
        return node.node is not None and _is_var_or_elems(node.node, name, key)
    if isinstance(node, nodes.Test):
        return _is_var_or_elems(node.node, name, key)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _is_var_or_elems(node.node, name, key)
    return _is_attr(node, name, key) if key else _is_var(node, name)


def _aliases(root: nodes.Template, name: str) -> Iterator[str]:
    """``name`` and every variable assigned from it, transitively (breadth first)."""
    yield name
    related = deque([name])
    while related:
        current = related.popleft()
        for assign in root.find_all(nodes.Assign):
            if _is_var_or_elems(assign.node, current):
                assert isinstance(assign.target, nodes.Name)
                yield assign.target.name
                if assign.target.name != current:
                    related.append(assign.target.name)


def _message_vars(root: nodes.Template) -> Iterator[str]:
    """The targets of ``{% for message in messages %}`` loops (or of an alias of it)."""
    names = list(_aliases(root, "messages"))
    for loop in root.find_all(nodes.For):
        if any(_is_var_or_elems(loop.iter, n) for n in names):
            assert isinstance(loop.target, nodes.Name)
            yield loop.target.name


def _macro_content_params(root: nodes.Template, messages: list[str]) -> tuple[
    dict[int, set[str]], set[int]
]:  # fmt: skip
    """Per loop inside a macro: the macro's parameters called with a message's content; and
    every loop inside a macro."""
    by_loop: dict[int, set[str]] = {}
    in_macros: set[int] = set()
    for macro in root.find_all(nodes.Macro):
        names = {a.name for a in macro.args}
        params: set[str] = set()
        for call in root.find_all(nodes.Call):
            if not (isinstance(call.node, nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(macro.args) and _reads_content(arg, messages):
                    params.add(macro.args[i].name)
            for kw in call.kwargs:
                if kw.key in names and _reads_content(kw.value, messages):
                    params.add(kw.key)
        for loop in macro.find_all(nodes.For):
            in_macros.add(id(loop))
            if params:
                by_loop[id(loop)] = params
    return by_loop, in_macros


def _reads_content(node: nodes.Node, messages: list[str]) -> bool:
    return any(_is_var_or_elems(node, m, "content") for m in messages)


def _content_loops(root: nodes.Template) -> Iterator[str]:
    """Loops over a message's content, directly or through a macro's parameter, or over a
    variable named ``content`` outside macros."""
    messages = list(_message_vars(root))
    by_loop, in_macros = _macro_content_params(root, messages)
    for loop in root.find_all(nodes.For):
        target = loop.target
        if _reads_content(loop.iter, messages):
            assert isinstance(target, nodes.Name)
            yield target.name
            continue
        params = by_loop.get(id(loop))
        it = loop.iter
        if isinstance(it, nodes.Name) and params is not None and it.name in params:
            assert isinstance(target, nodes.Name)
            yield target.name
            continue
        if id(loop) not in in_macros and isinstance(it, nodes.Name) and it.name == "content":
            assert isinstance(target, nodes.Name)
            yield target.name
