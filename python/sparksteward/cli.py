"""The ``steward`` command (also ``python -m sparksteward``).

Subcommands: ``jar`` (print the shim jar's path, building it if needed), ``config`` (the option table),
``connect-server`` (a Spark Connect server with the plugin),
``jobs`` (the JobResultStore), ``blobs`` (blob storage), ``checkpoints`` (keyed-state checkpoints) and
``state`` (keyed state offline: show, read, diff, bootstrap).
Errors print one line naming the problem and exit with status 2; there are no tracebacks for expected
failures.

Every subcommand of the groups that open stores takes ``--conf spark.steward.storage.options=JSON`` (as
``spark-submit`` does; repeatable, the last wins): the fsspec options per protocol the agents of the
application use, such as an S3 endpoint, applied to every store the command opens.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from sparksteward.config import parse_setting
from sparksteward.errors import ConfigError, StewardError
from sparksteward.storage import OPTIONS_KEY, default_options, set_default_options

__all__ = ["main"]

_GROUPS = ("sparksteward.jobs.cli", "sparksteward.blob.cli", "sparksteward.checkpoint.cli", "sparksteward.state_cli")


def _cmd_jar(args: argparse.Namespace) -> int:
    from sparksteward.jar import shim_jar

    print(shim_jar(rebuild=args.rebuild))
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    from sparksteward.config import render_defaults_conf, render_markdown

    print(render_defaults_conf() if args.format == "conf" else render_markdown(), end="")
    return 0


def _cmd_connect_server(args: argparse.Namespace) -> int:
    import os
    import shlex

    from sparksteward.session import connect_server_command

    extra = args.spark_submit_args[1:] if args.spark_submit_args[:1] == ["--"] else args.spark_submit_args
    cmd = connect_server_command(port=args.port, extra=extra)
    if args.print:
        print(shlex.join(cmd))
        return 0
    if not os.environ.get("SPARK_HOME"):   # pip's pyspark: spark-submit finds its home only with python on PATH
        import pyspark

        os.environ["SPARK_HOME"] = os.path.dirname(pyspark.__file__)
    # a Connect server runs its clients' Python UDFs with $PYSPARK_PYTHON (not spark.pyspark.python): this
    # Python, which has spark-steward installed, unless one was chosen
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    sys.stdout.flush()
    os.execv(cmd[0], cmd)   # the server in this process: a supervisor (systemd, a pod) sees it directly
    return 1   # not reached: execv replaces this process or raises


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="steward", description="spark-steward: Flink's runtime services for PySpark")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("jar", help="print the path of the shim jar, building it if needed")
    p.add_argument("--rebuild", action="store_true", help="rebuild even if a cached jar exists")
    p.set_defaults(func=_cmd_jar)
    p = sub.add_parser("config", help="print every spark.steward.* option with its default")
    p.add_argument("--format", choices=("markdown", "conf"), default="markdown")
    p.set_defaults(func=_cmd_config)
    p = sub.add_parser("connect-server", help="run a Spark Connect server with spark-steward (spark-submit)",
                       description="Run a Spark Connect server with the plugin, its jar and settings (decision 0030); "
                                   "arguments after -- go to spark-submit (--master, --conf ...).")
    p.add_argument("--port", type=int, help="the gRPC port (spark.connect.grpc.binding.port; Spark's default 15002)")
    p.add_argument("--print", action="store_true", help="print the spark-submit command instead of running it")
    p.add_argument("spark_submit_args", nargs=argparse.REMAINDER, help="-- then spark-submit's own arguments")
    p.set_defaults(func=_cmd_connect_server)
    for name in _GROUPS:
        before = set(sub.choices)
        importlib.import_module(name).add_subcommands(sub)
        for group in set(sub.choices) - before:
            _add_conf(sub.choices[group])
    return parser


def _add_conf(parser: argparse.ArgumentParser) -> None:
    """``--conf`` on every subcommand under ``parser``."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        parser.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE",
                            help=f"{OPTIONS_KEY}=JSON: fsspec options per protocol for the stores this opens "
                                 f"(as the application's agents use them)")
    for action in subs:
        for child in set(action.choices.values()):
            _add_conf(child)


def _apply_conf(pairs: list[str]) -> None:
    """Apply ``--conf`` settings: the storage options become this process's defaults."""
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep:   # not echoed: it may be a value, credentials and all
            raise ConfigError(f"a --conf without '=': give KEY=VALUE, such as --conf {OPTIONS_KEY}='{{\"s3\": {{...}}}}'")
        if key != OPTIONS_KEY:
            raise ConfigError(f"--conf {key}: this command takes only {OPTIONS_KEY} as --conf; give the rest as "
                              f"its own flags (--cluster-id, --path, ...; see --help)")
        set_default_options(parse_setting(OPTIONS_KEY, value))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    before = default_options()   # a command run in a process that goes on (a test, a notebook) leaves them as they were
    try:
        _apply_conf(getattr(args, "conf", []))
        return int(args.func(args) or 0)
    except StewardError as exc:
        print(f"steward: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        set_default_options(before)


if __name__ == "__main__":
    sys.exit(main())
