#!/usr/bin/env python3
"""Render gpupool's Grafana dashboards (defined as code in gpupool/ops/dashboards.py) to JSON.

    .venv/bin/python docker/grafana/generate.py           # rewrite docker/grafana/dashboards/
    .venv/bin/python docker/grafana/generate.py --check   # exit 1 if the committed JSON is stale

Needs grafana-foundation-sdk (a dev dependency). The JSON is committed so that Grafana's file
provisioning (provisioning/dashboards/gpupool.yml) loads it without running Python.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))  # run from a checkout without installing

from gpupool.ops.dashboards import dashboards  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="Compare, do not write.")
    parser.add_argument("--out", type=Path, default=HERE / "dashboards", help="Output folder.")
    args = parser.parse_args(argv)
    stale = []
    for name, text in dashboards().items():
        path = args.out / name
        if path.is_file() and path.read_text(encoding="utf-8") == text:
            continue
        stale.append(path)
        if not args.check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
    for path in stale:
        print(f"{'stale' if args.check else 'wrote'}: {path}")
    if args.check and stale:
        print("run: .venv/bin/python docker/grafana/generate.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
