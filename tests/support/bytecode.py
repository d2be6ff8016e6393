"""Compiled modules are kept between processes (a pytest plugin, loaded first by
``tests/conftest.py``).

Where ``PYTHONDONTWRITEBYTECODE`` is set (this machine's environment sets it), every process
compiles every module it imports from source: each ``gpupool serve`` a test starts spent 0.15 s
of CPU compiling the package's 174 modules, each simulated worker its own share, and each
pytest-xdist worker the tests' (0.55 -> 0.44 s of CPU for a gateway's start and stop, measured
at ``fdcc3cf``). Here the test process and every process it starts write and reuse bytecode,
under ``PYTHONPYCACHEPREFIX`` (a folder in the temporary directory unless already set), so
nothing is written in the checkout.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

os.environ.pop("PYTHONDONTWRITEBYTECODE", None)  # the children: gateways, workers, helpers
os.environ.setdefault("PYTHONPYCACHEPREFIX", str(Path(tempfile.gettempdir()) / "gpupool-pycache"))
sys.dont_write_bytecode = False  # this process, from the next import on
sys.pycache_prefix = os.environ["PYTHONPYCACHEPREFIX"]
