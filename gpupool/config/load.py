"""Load ``gpupool.yaml`` into :class:`GpupoolConfig`, with errors that name the field path."""

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


def _problems(err: ValidationError) -> list[str]:
    problems = []
    for e in err.errors():
        where = _path(tuple(e["loc"]))
        msg = e["msg"].removeprefix("Value error, ")
        problems.append(f"{where}: {msg}" if where else msg)
    return problems


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
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError([f"{path}: not valid YAML: {e}"]) from None
    return parse_config(data)
