"""Every snippet the documentation marks runnable runs, against a gateway on the simulator.

The snippets' syntax is in ``tests/docs/snippets.py``. A planted page shows that a snippet that no
longer runs, a config that no longer loads, and a mistyped marker each fail.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from sybil.example import SybilFailure

from tests.docs.snippets import ROOT, Gateways, SnippetError, documents, examples_in, run_document


@pytest.fixture(scope="module")
def gateways(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateways]:
    pool = Gateways(tmp_path_factory.mktemp("docs-gateways"))
    try:
        yield pool
    finally:
        pool.close()


@pytest.mark.parametrize("path", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_snippets_run(path: Path, gateways: Gateways) -> None:
    assert run_document(path, gateways) > 0


def test_the_newcomer_paths_are_runnable() -> None:
    """The pages a newcomer starts from run their code, not just show it."""
    wanted = {
        "README.md": {("config", "yaml"), ("run", "python")},
        "docs/getting-started/workstation.md": {
            ("run", "python"), ("run", "sh"), ("config", "yaml"),
        },
        "docs/getting-started/sleep-mode.md": {("serve", "yaml"), ("run", "python"), ("run", "sh")},
        "docs/getting-started/gpu-node.md": {("run", "sh")},
        "docs/guides/queueing.md": {("serve", "yaml"), ("run", "python")},  # a real 429
    }  # fmt: skip
    for page, kinds in wanted.items():
        assert kinds <= set(examples_in(ROOT / page)), page


PLANTED_RUN = """# A page

<!-- test: run -->
```python
from openai import OpenAI

client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
```
"""


def test_a_snippet_that_no_longer_runs_fails(tmp_path: Path, gateways: Gateways) -> None:
    page = tmp_path / "page.md"
    page.write_text(PLANTED_RUN)
    with pytest.raises(SybilFailure, match="NotFoundError"):
        run_document(page, gateways)
    page.write_text(PLANTED_RUN.replace("no-such-model", "qwen3.5"))  # the same, fixed
    assert run_document(page, gateways) == 1


def test_a_shell_snippet_that_fails_fails(tmp_path: Path, gateways: Gateways) -> None:
    page = tmp_path / "page.md"
    page.write_text("<!-- test: run -->\n```sh\ngpupool check --config no/such/file.yaml\n```\n")
    with pytest.raises(SybilFailure, match=re.escape("page.md:1: exit 2")):
        run_document(page, gateways)


def test_a_config_that_no_longer_loads_fails(tmp_path: Path, gateways: Gateways) -> None:
    page = tmp_path / "page.md"
    page.write_text("<!-- test: config -->\n```yaml\nmodels: [{name: m}]\nworkers: []\n```\n")
    with pytest.raises(SybilFailure, match="gpupool check failed"):
        run_document(page, gateways)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("<!-- test: rnu -->\n```python\npass\n```\n", "unknown `test: rnu`"),
        ("<!-- test: run -->\nno block here\n", "not followed by a fenced block"),
        ("<!-- test: config -->\n```python\npass\n```\n", "takes ['yaml'], not python"),
    ],
)
def test_a_mistyped_marker_is_an_error(tmp_path: Path, text: str, message: str) -> None:
    page = tmp_path / "page.md"
    page.write_text(text)
    with pytest.raises(SnippetError, match=re.escape(message)):
        list(examples_in(page))
