"""Load ``gpupool.yaml`` into :class:`GpupoolConfig`, with errors that name the field path and,
for a file, its line (``gpupool.yaml:12: queue.max_wait_s: ...``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from gpupool.config.models import GpupoolConfig


class ConfigError(Exception):
    """The configuration file is unreadable or invalid. ``str()`` lists every problem."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


def _path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + part
    return out


def _problems(err: ValidationError, path: str | Path | None = None, root: Any = None) -> list[str]:
    problems = []
    for e in err.errors():
        loc = tuple(e["loc"])
        where = _path(loc)
        msg = e["msg"].removeprefix("Value error, ")
        problem = f"{where}: {msg}" if where else msg
        if path is not None:
            at = f":{line_of(root, loc)}" if loc and root is not None else ""
            problem = f"{path}{at}: {problem}"
        problems.append(problem)
    return problems


def line_of(root: Any, loc: tuple[Any, ...]) -> int:
    """The 1-based line of the YAML node at ``loc`` under ``root`` (``yaml.compose``'s), or of
    the deepest node on the way that exists (a missing field: its parent)."""
    node = root
    for part in loc:
        child = _child(node, part)
        if child is None:
            break
        node = child
    return int(node.start_mark.line) + 1 if node is not None else 1


def _child(node: Any, part: Any) -> Any:
    if isinstance(node, yaml.SequenceNode) and isinstance(part, int):
        return node.value[part] if 0 <= part < len(node.value) else None
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            if k.value == part:
                return v
    return None


def parse_config(data: Any) -> GpupoolConfig:
    if not isinstance(data, dict):
        raise ConfigError(["the configuration must be a mapping"])
    try:
        return GpupoolConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_problems(e)) from None


def load_config(path: str | Path) -> GpupoolConfig:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError([f"{path}: cannot read: {e.strerror}"]) from None
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError([f"{path}: not valid YAML: {e}"]) from None
    twice = duplicate_keys(root)
    if twice:
        raise ConfigError([f"{path}:{line}: {problem}" for line, problem in twice])
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: the configuration must be a mapping"])
    try:
        return GpupoolConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_problems(e, path, root)) from None


def duplicate_keys(root: yaml.Node | None) -> list[tuple[int, str]]:
    """Every key given twice in one mapping, anywhere under ``root``: (the later line, the
    problem naming both lines). YAML loaders keep the last silently, so a second ``auth:``
    section would quietly replace the first."""
    found: list[tuple[int, str]] = []
    todo: list[tuple[yaml.Node, str]] = [(root, "")] if root is not None else []
    while todo:
        node, where = todo.pop()
        if isinstance(node, yaml.SequenceNode):
            todo += [(child, f"{where}[{i}]") for i, child in enumerate(node.value)]
        if not isinstance(node, yaml.MappingNode):
            continue
        first: dict[str, int] = {}
        for key, value in node.value:
            name = str(key.value)
            at = f"{where}.{name}" if where else name
            line = int(key.start_mark.line) + 1
            if key.tag == "tag:yaml.org,2002:merge":
                pass  # `<<: *base` merges; its keys are overridden on purpose
            elif name in first:
                found.append((line, f"{at}: given twice, on lines {first[name]} and {line} "
                                    "(YAML would keep only the last); remove one"))  # fmt: skip
            else:
                first[name] = line
            todo.append((value, at))
    return sorted(found)
