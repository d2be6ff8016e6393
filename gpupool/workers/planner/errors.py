"""Errors the planner raises; the CLI renders them in one place.

::

    PlannerError                 anything the planner cannot work with
    ├── ModelConfigError         config.json unreadable, not JSON, or missing a required field
    │   └── ModelNotFoundError   no config.json anywhere: local path, HF cache, Hub, built-in
    └── PlanArgsError            an argument value it cannot interpret (``--max-model-len x``)
"""

from __future__ import annotations


class PlannerError(Exception):
    """Base of the planner's errors. ``str()`` is a message for a user."""


class ModelConfigError(PlannerError):
    """The model's ``config.json`` cannot be read into a :class:`ModelSpec`."""


class ModelNotFoundError(ModelConfigError):
    """No ``config.json`` for a model reference; the message names every place tried."""


class PlanArgsError(PlannerError):
    """A launch argument has a value the planner cannot interpret."""
