"""The content form vLLM hands a chat template, detected from its syntax tree.

Each template's expected form is what vLLM 0.32's ``_detect_content_format`` answered for it
(``vllm/renderers/hf.py``, run on these templates with the vLLM venv's interpreter)."""

from __future__ import annotations

import jinja2.ext
import pytest

from gpupool.workers.kvevents.content_format import detect
from gpupool.workers.kvevents.render import _Sandbox

TEMPLATES = {
    "string content": (
        "{%- for message in messages %}{{ message['role'] + ': ' + message['content'] }}"
        "{%- endfor %}",
        "string",
    ),
    "a loop over each message's parts": (
        "{%- for m in messages %}{%- for p in m.content %}{{ p.text }}{%- endfor %}{%- endfor %}",
        "openai",
    ),
    "through an alias of messages and a filter": (
        "{%- set msgs = messages[1:] %}{%- for m in msgs %}{%- for p in m.content | list %}"
        "{{ p.text }}{%- endfor %}{%- endfor %}",
        "openai",
    ),
    "through a variable named content": (
        "{%- for m in messages %}{%- set content = m.content %}{%- for p in content %}{{ p }}"
        "{%- endfor %}{%- endfor %}",
        "openai",
    ),
    "through a macro's positional parameter": (
        "{%- macro render(c) %}{%- for part in c %}{{ part.text }}{%- endfor %}{%- endmacro %}"
        "{%- for m in messages %}{{ render(m.content) }}{%- endfor %}",
        "openai",
    ),
    "through a macro's keyword parameter": (
        "{%- macro render(x, y) %}{%- for part in y %}{{ part.text }}{%- endfor %}"
        "{%- endmacro %}{%- for m in messages %}{{ render(1, y=m['content']) }}{%- endfor %}",
        "openai",
    ),
    "a macro looping over a parameter never given content": (
        "{%- macro f(content) %}{%- for p in content %}{{ p }}{%- endfor %}{%- endmacro %}"
        "{%- for m in messages %}{{ m.content }}{%- endfor %}",
        "string",
    ),
    "one that does not parse": ("{% for m in messages %}{{ m.content {% endfor %}", "string"),
}


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_the_form_is_vllms(name: str) -> None:
    source, expected = TEMPLATES[name]
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    assert detect(env, source) == expected
