"""The ``steward`` command (also ``python -m sparksteward``).

Subcommands: ``jar`` (print the shim jar's path, building it if needed), ``config`` (the option table),
``jobs`` (the JobResultStore), ``blobs`` (blob storage) and ``checkpoints`` (keyed-state checkpoints).
Errors print one line naming the problem and exit with status 2; there are no tracebacks for expected
failures.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from sparksteward.errors import StewardError

__all__ = ["main"]

_GROUPS = ("sparksteward.jobs.cli", "sparksteward.blob.cli", "sparksteward.checkpoint.cli")


def _cmd_jar(args: argparse.Namespace) -> int:
    from sparksteward.jar import shim_jar

    print(shim_jar(rebuild=args.rebuild))
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    from sparksteward.config import render_defaults_conf, render_markdown

    print(render_defaults_conf() if args.format == "conf" else render_markdown(), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="steward", description="spark-steward: Flink's runtime services for PySpark")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("jar", help="print the path of the shim jar, building it if needed")
    p.add_argument("--rebuild", action="store_true", help="rebuild even if a cached jar exists")
    p.set_defaults(func=_cmd_jar)
    p = sub.add_parser("config", help="print every spark.steward.* option with its default")
    p.add_argument("--format", choices=("markdown", "conf"), default="markdown")
    p.set_defaults(func=_cmd_config)
    for name in _GROUPS:
        importlib.import_module(name).add_subcommands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except StewardError as exc:
        print(f"steward: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
