"""Where an agent's log lines go: Spark's convention, a quiet console and a detailed file.

- **stderr** (the JVM's, so the lines land in Spark's driver and executor logs) gets the level
  ``spark.steward.log.level`` names; the environment variable ``SPARK_STEWARD_LOG_LEVEL``, when set,
  overrides it. When neither names one, the console follows Spark's: ``spark.log.level`` at start (else
  WARNING), then each change of the JVM's log4j root level (``sc.setLogLevel``), which the shim sends as a
  ``log_level`` line (:func:`follow`).
- **A log file** of the agent's own gets INFO and above (the console's level when that is lower):
  ``<state-dir>/logs/driver-agent.log`` or ``executor-agent-<executor id>.log``, rotated at
  :data:`MAX_BYTES` with :data:`BACKUPS` old files kept. Successive applications on a host append to
  the same file; every line carries the agent's pid. ``health()`` names the file (``log_file``). When
  the file cannot be opened the agent runs on with the console alone, and says so there. An executor
agent on a host where the state dir does not exist (another machine than the driver's) does not create
it: its file goes to ``steward-logs/`` in YARN's container log dir (``LOG_DIRS``) or else in the
executor's working directory, beside Spark's own ``stderr`` of the executor.

:func:`console` runs before the agent's configuration is known (so a bad ``hello`` is still reported);
:func:`configure` then applies the configuration. Both change the process's root logger: only the
agent entry point (:func:`sparksteward.agents.base.run_agent`) calls them.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path

from sparksteward.config import LOG_LEVELS, StewardConfig, log_level
from sparksteward.owner import private_dir

__all__ = ["BACKUPS", "ENV_LEVEL", "MAX_BYTES", "configure", "console", "console_level", "follow", "log_dir", "log_file_name", "pinned"]

log = logging.getLogger("sparksteward.agents")

ENV_LEVEL = "SPARK_STEWARD_LOG_LEVEL"
MAX_BYTES = 10 << 20
BACKUPS = 5
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_FILE_FORMAT = "%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s"
_HANDLER = "sparksteward-agent-console"


def console() -> logging.Handler:
    """Install the stderr handler at WARNING (or ``SPARK_STEWARD_LOG_LEVEL``) and return it."""
    root = logging.getLogger()
    handler = _console_handler()
    if handler is None:
        handler = logging.StreamHandler(sys.stderr)
        handler.set_name(_HANDLER)
        handler.setFormatter(logging.Formatter(_FORMAT))
        root.addHandler(handler)
    handler.setLevel(_env_level() or logging.WARNING)
    root.setLevel(handler.level)
    return handler


def pinned(conf: Mapping[str, str]) -> bool:
    """Whether the agent's console level is set (the environment or ``spark.steward.log.level`` in the
    ``hello``'s ``conf``) and so does not follow Spark's."""
    return _env_level() is not None or "spark.steward.log.level" in conf


def configure(handler: logging.Handler, cfg: StewardConfig, file_name: str, spark_level: str | None = None) -> Path | None:
    """Set the console ``handler`` to the configured level (``spark_level``, Spark's ``spark.log.level``,
    when nothing pins it) and open the agent's log file; return its path (None when it could not be
    opened)."""
    level = _env_level() or _level_or_none(spark_level) or log_level(cfg.log_level)
    handler.setLevel(level)
    file_level = min(level, logging.INFO)
    logging.getLogger().setLevel(file_level)
    path = log_dir(cfg, executor=file_name.startswith("executor-")) / file_name
    try:
        private_dir(path.parent)
        rotating = logging.handlers.RotatingFileHandler(path, maxBytes=MAX_BYTES, backupCount=BACKUPS,
                                                        encoding="utf-8")
    except OSError as exc:
        logging.getLogger().setLevel(level)
        log.warning("cannot write the agent's log file %s (%s); logging to stderr only", path, exc)
        return None
    rotating.setLevel(file_level)
    rotating.setFormatter(logging.Formatter(_FILE_FORMAT))
    logging.getLogger().addHandler(rotating)
    return path


def follow(name: str, *, quieter_only: bool = False) -> None:
    """Spark's log level is now ``name`` (a log4j name from the shim's ``log_level`` line): the console
    takes it (with ``quieter_only``, only when it is quieter than the console's), the log file INFO or
    that level when lower. The caller checks :func:`pinned` first."""
    level = _level_or_none(name)
    if level is None:
        log.warning("Spark's log level %r is not one we know; the agent's console keeps its level", name)
        return
    root = logging.getLogger()
    console = _console_handler()
    if quieter_only and console is not None and level <= console.level:
        return
    file_level = min(level, logging.INFO)
    for handler in root.handlers:
        if handler.get_name() == _HANDLER:
            handler.setLevel(level)
        elif isinstance(handler, logging.handlers.RotatingFileHandler):
            handler.setLevel(file_level)
    has_file = any(isinstance(h, logging.handlers.RotatingFileHandler) for h in root.handlers)
    root.setLevel(file_level if has_file else level)
    log.info("console log level now %s, Spark's (sc.setLogLevel)", name)


def console_level() -> str:
    """The console's level now, as log4j names it (``WARN``, ``ERROR``, ...)."""
    handler = _console_handler()
    level = logging.WARNING if handler is None else handler.level
    names = {value: name for name, value in LOG_LEVELS.items() if name in ("DEBUG", "INFO", "WARN", "ERROR", "FATAL", "OFF")}
    return names.get(level, str(level))


def log_dir(cfg: StewardConfig, *, executor: bool) -> Path:
    """Where the agent's log file goes (see the module docstring)."""
    state = Path(os.path.expanduser(cfg.effective_state_dir.removeprefix("file://")))
    if not executor or state.is_dir():
        return state / "logs"
    yarn = os.environ.get("LOG_DIRS", "").split(",")[0].strip()
    return (Path(yarn) if yarn else Path.cwd()) / "steward-logs"   # a dir of its own: it is made private


def log_file_name(role: str, executor_id: str | None = None) -> str:
    """``driver-agent.log``, or ``executor-agent-<id>.log`` with the id made safe for a file name."""
    if role != "executor":
        return f"{role}-agent.log"
    return f"executor-agent-{re.sub(r'[^A-Za-z0-9._-]', '_', executor_id or 'unknown')[:100]}.log"


def _console_handler() -> logging.Handler | None:
    return next((h for h in logging.getLogger().handlers if h.get_name() == _HANDLER), None)


def _level_or_none(name: str | None) -> int | None:
    try:
        return None if not name else log_level(name)
    except ValueError:
        return None


def _env_level() -> int | None:
    raw = os.environ.get(ENV_LEVEL, "").strip()
    if not raw:
        return None
    try:
        return log_level(raw)
    except ValueError:
        try:
            return int(raw)
        except ValueError:
            log.warning("%s=%r is not a level (TRACE, DEBUG, INFO, WARN, ERROR or OFF); ignored", ENV_LEVEL, raw)
            return None
