"""A finding: one problem or risk in a worker's configuration, with the field it is about."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Level(StrEnum):
    error = "error"
    warning = "warning"


@dataclass(frozen=True, slots=True)
class Finding:
    """``path`` names the configuration field, e.g. ``workers[0].launch.args.max-num-seqs``."""

    level: Level
    path: str
    message: str

    def under(self, prefix: str) -> Finding:
        """The same finding with ``prefix.`` put before its path."""
        path = f"{prefix}.{self.path}" if self.path else prefix
        return Finding(self.level, path, self.message)

    def to_dict(self) -> dict[str, str]:
        return {"level": self.level.value, "path": self.path, "message": self.message}


def error(path: str, message: str) -> Finding:
    return Finding(Level.error, path, message)


def warning(path: str, message: str) -> Finding:
    return Finding(Level.warning, path, message)


def has_errors(findings: list[Finding] | tuple[Finding, ...]) -> bool:
    return any(f.level is Level.error for f in findings)
