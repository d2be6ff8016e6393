"""Errors the supervisor raises to its callers (CLI, admin endpoints, config reload).

    SupervisorError
    ├── LaunchConfigError    a `launch:` section gpupool cannot run as given (also a ValueError,
    │                        so a pydantic validator may raise it and name the field)
    ├── UnknownWorker        no supervised worker by that name
    └── WorkerExists         add() of a name already supervised

Worker crashes are not exceptions: they are recorded on the registry's ``Worker``
(``last_error``, ``last_log_lines``, ``restarts``, state ``failed``).
"""

from __future__ import annotations


class SupervisorError(Exception):
    """Base of every error the supervisor raises."""


class LaunchConfigError(SupervisorError, ValueError):
    """The launch configuration cannot be turned into a command. ``problems`` lists each one."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


class UnknownWorker(SupervisorError, LookupError):
    """No supervised worker has this name."""

    def __init__(self, name: str) -> None:
        super().__init__(f"no supervised worker named `{name}`")
        self.name = name


class WorkerExists(SupervisorError):
    """A supervised worker with this name already exists."""

    def __init__(self, name: str) -> None:
        super().__init__(f"a supervised worker named `{name}` already exists")
        self.name = name
