"""``gpupool --version`` prints the installed package's version (its metadata, not a constant)."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version

from tests.support.procs import ROOT


def test_version_is_the_package_metadata() -> None:
    r = subprocess.run([sys.executable, "-m", "gpupool", "--version"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"gpupool, version {version('gpupool')}"
