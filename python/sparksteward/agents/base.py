"""What the driver and executor agents share: the stdin event loop, the socket, health, shutdown.

An agent is started by the JVM shim with its stdin and stdout as pipes (see ``docs/protocol.md``):

1. read ``hello`` from stdin and parse the configuration; a bad value ends the agent with a ``fatal``
   line naming the key, which the driver shim turns into a failed SparkContext start;
2. open the authenticated socket and print ``ready``;
3. handle one event per stdin line until ``shutdown`` or EOF. EOF is how an agent learns that its JVM
   died, SIGKILL included; either way it closes what it owns and exits.

Logs: stderr gets WARNING and above (``spark.steward.log.level``), the agent's own rotated log file
INFO and above; see :mod:`sparksteward.agents.logs`.

Thread-safety: events are handled on the main thread, in order; socket requests run on the server's
threads, so state shared with request handlers is guarded by ``self.lock``.
"""

from __future__ import annotations

import collections
import enum
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, BinaryIO

import orjson

from sparksteward import shim_protocol
from sparksteward.agents import logs
from sparksteward.clock import SystemClock
from sparksteward.config import StewardConfig
from sparksteward.errors import ConfigError, JobAlreadyCompleted, ProtocolError, StewardError
from sparksteward.storage import set_default_options
from sparksteward.wire import AgentServer, Connection, Fields

__all__ = ["Agent", "AgentState", "run_agent"]

log = logging.getLogger("sparksteward.agents")

_RECENT_EVENTS = 2000


class AgentState(str, enum.Enum):
    """Where an agent is in its life; ``health`` reports the value."""

    STARTING = "starting"   # built, not yet announced to the shim
    RUNNING = "running"     # ``ready`` printed: handling events and requests
    STOPPING = "stopping"   # the event loop ended (shutdown, stdin EOF or SIGTERM); closing
    STOPPED = "stopped"     # closed


class Agent:
    """Base class: owns the socket and the bookkeeping every agent reports in ``health``."""

    role = "agent"
    log_file: str | None = None
    """The agent's own log file (:mod:`sparksteward.agents.logs`); None when it has none."""

    def __init__(self, hello: dict[str, Any], clock: Any = None, cfg: StewardConfig | None = None) -> None:
        self.hello = hello
        self.cfg = cfg or StewardConfig.from_conf({str(k): str(v) for k, v in hello["conf"].items()})
        set_default_options(self.cfg.storage_options)
        self.clock = clock or SystemClock()
        self.secret: str = hello["secret"]
        self.started = time.monotonic()
        self.state = AgentState.STARTING
        self.lock = threading.Lock()
        self.events_seen: collections.Counter[str] = collections.Counter()
        # (sequence number, encoded size, event), oldest first; bounded in count and in bytes
        self.recent: collections.deque[tuple[int, int, dict[str, Any]]] = collections.deque()
        self._recent_bytes = 0
        self._event_seq = 0
        self.events_dropped = 0
        self._told_level = False   # a log_level line came (the first is the JVM's level at start)
        self.server = AgentServer(hello["bind_host"], hello["port"], self.secret,
                                  {"health": self._op_health, "events": self._op_events},
                                  max_message=self.cfg.rpc_max_message_size, timeout=self.cfg.rpc_timeout,
                                  handshake_timeout=self.cfg.rpc_handshake_timeout,
                                  max_handshakes=self.cfg.rpc_max_pending_handshakes,
                                  max_connections=self.cfg.rpc_max_connections)

    @property
    def advertised_endpoint(self) -> str:
        host = self.hello.get("host") or self.server.host
        return f"{host}:{self.server.port}" if self.role == "driver" else self.server.endpoint

    def shutdown_grace_ms(self) -> int:
        return 10_000

    # --- events ------------------------------------------------------------------------------
    def handle(self, msg: dict[str, Any]) -> None:
        kind = msg["type"]
        size = len(orjson.dumps(msg))
        limit = self.cfg.agent_events_max_bytes
        with self.lock:
            self.events_seen[kind] += 1
            self._event_seq += 1
            if size > limit:
                self.events_dropped += 1
            else:
                self.recent.append((self._event_seq, size, msg))
                self._recent_bytes += size
                while len(self.recent) > _RECENT_EVENTS or self._recent_bytes > limit:
                    self._recent_bytes -= self.recent.popleft()[1]
                    self.events_dropped += 1
        handler = getattr(self, f"on_{kind}", None)
        if handler is not None:
            handler(msg)

    def on_log_level(self, msg: dict[str, Any]) -> None:
        """The JVM's log level: the first line gives it at start, each next one a change (``sc.setLogLevel``).
        Unless the configuration pins ours, the console follows every change, and the level at start only
        where it is quieter than ours (spark-submit starts Spark at INFO; an executor that Spark started
        after a ``sc.setLogLevel`` starts at that level)."""
        first, self._told_level = not self._told_level, True
        if not logs.pinned(self.hello["conf"]):
            logs.follow(msg["level"], quieter_only=first)

    # --- requests ----------------------------------------------------------------------------
    def _op_health(self, conn: Connection, req: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            seen = dict(self.events_seen)
        return {"role": self.role, "state": self.state.value, "pid": os.getpid(),
                "uptime_s": round(time.monotonic() - self.started, 3), "events_seen": seen,
                "auth_failures": self.server.auth_failures, "handshakes_dropped": self.server.handshakes_dropped,
                "handshakes": self.server.handshakes, "requests": self.server.request_counts(),
                "events_dropped": self.events_dropped, "log_file": self.log_file,
                "log_level": logs.console_level(), **self.health_details()}

    def health_details(self) -> dict[str, Any]:
        return {}

    def _op_events(self, conn: Connection, req: dict[str, Any]) -> dict[str, Any]:
        f = Fields(req)
        kind = f.text("type", default=None)
        limit = f.integer("limit", default=1000, lo=1, hi=100_000)
        after = f.integer("after", default=0, lo=0)
        budget = self.cfg.rpc_max_message_size // 2
        out: list[dict[str, Any]] = []
        used, last, more = 0, None, False
        with self.lock:
            for seq, size, event in self.recent:
                if seq <= after or (kind is not None and event["type"] != kind):
                    continue
                if len(out) >= limit or (out and used + size > budget):
                    more = True
                    break
                out.append(event)
                used += size
                last = seq
        return {"events": out, "next": last if more else None}

    # --- requests from the shim over the pipes (decision 0009) --------------------------------------
    #: ops the shim may call over the pipes; each runs the socket op's own handler
    PIPE_OPS = {"open_file": "blob.open_file"}

    def attach_stdout(self, out: BinaryIO) -> None:
        """Where ``reply`` lines go (the shim's end of the agent's stdout)."""
        self._stdout, self._stdout_lock = out, threading.Lock()

    def to_shim(self, line: bytes) -> None:
        """Write one agent → shim line (``reply``, ``metrics``) on stdout, whole; never raises."""
        out = getattr(self, "_stdout", None)
        if out is not None:
            with self._stdout_lock:
                _write(out, line)

    def on_open_file(self, msg: dict[str, Any]) -> None:
        # on a pool thread: a fetch must not hold up the event loop (task events, shutdown)
        with self.lock:
            if getattr(self, "_pipe_pool", None) is None:
                from concurrent.futures import ThreadPoolExecutor

                self._pipe_pool = ThreadPoolExecutor(8, thread_name_prefix="steward-pipe")
            self._pipe_pool.submit(self._answer_pipe, msg)

    def _answer_pipe(self, msg: dict[str, Any]) -> None:
        op = self.PIPE_OPS[msg["type"]]
        handler = self.server.handler(op)
        try:
            if handler is None:
                raise ProtocolError(f"the {self.role} agent does not serve {op}")
            # (ignore:) a pipe op comes without a connection, and its handler takes Connection | None
            line = shim_protocol.encode_reply(msg["id"], handler(None, {**msg, "op": op}))  # type: ignore[arg-type]
        except StewardError as exc:
            line = shim_protocol.encode_reply(msg["id"], code=exc.code, message=str(exc))
        except Exception as exc:  # the shim must get an answer, never wait for one
            log.exception("%s for the shim failed", op)
            line = shim_protocol.encode_reply(msg["id"], code="INTERNAL", message=f"{type(exc).__name__}: {exc}")
        out = getattr(self, "_stdout", None)
        if out is not None:
            with self._stdout_lock:
                _write(out, line)

    def close(self) -> None:
        """Stop serving and release what the agent owns. Subclasses extend; must stay idempotent."""
        self.state = AgentState.STOPPED
        pool = getattr(self, "_pipe_pool", None)
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        self.server.close()


def _write(out: BinaryIO, line: bytes) -> None:
    try:
        out.write(line)
        out.flush()
    except OSError:  # the JVM is gone; nothing to tell it
        pass


def _on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_agent(agent_cls: type[Agent], stdin: BinaryIO | None = None, stdout: BinaryIO | None = None) -> int:
    """Run an agent until shutdown or stdin EOF; return the process exit code."""
    console = logs.console()
    stdin = stdin or sys.stdin.buffer
    if stdout is None:
        stdout = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
        sys.stdout = sys.stderr  # a stray print() must not corrupt the protocol channel
    role = agent_cls.role
    signal.signal(signal.SIGTERM, _on_sigterm)

    try:
        hello = shim_protocol.decode(stdin.readline(shim_protocol.MAX_LINE + 1))
        if hello["type"] != "hello":
            raise ProtocolError(f"the first message must be hello, not {hello['type']}")
        # the driver agent warns about unknown keys; executor agents get the same conf
        cfg = StewardConfig.from_conf({str(k): str(v) for k, v in hello["conf"].items()}, warn=role == "driver")
        conf = hello["conf"]
        log_file = logs.configure(console, cfg, logs.log_file_name(role, hello.get("executor_id")),
                                  None if logs.pinned(conf) else conf.get("spark.log.level"))
        agent = agent_cls(hello, cfg=cfg)
        agent.log_file = None if log_file is None else str(log_file)
    except (ConfigError, ProtocolError, JobAlreadyCompleted) as exc:
        log.error("%s agent cannot start: %s", role, exc)
        _write(stdout, shim_protocol.encode_fatal(role, exc.code, str(exc)))
        return 2
    except (StewardError, OSError) as exc:
        code = "PORT_IN_USE" if isinstance(exc, OSError) and exc.errno == 98 else "STARTUP_FAILED"
        log.exception("%s agent cannot start", role)
        _write(stdout, shim_protocol.encode_fatal(role, code, f"{type(exc).__name__}: {exc}"))
        return 2

    agent.state = AgentState.RUNNING
    agent.attach_stdout(stdout)
    _write(stdout, shim_protocol.encode_ready(role, os.getpid(), agent.advertised_endpoint,
                                              agent.shutdown_grace_ms()))
    log.info("%s agent %d ready on %s", role, os.getpid(), agent.server.endpoint)
    try:
        while True:
            line = stdin.readline(shim_protocol.MAX_LINE + 1)
            if not line:
                log.info("%s agent: stdin closed, exiting", role)
                break
            if not line.strip():
                continue
            try:
                msg = shim_protocol.decode(line)
            except ProtocolError as exc:
                log.warning("ignoring bad protocol line: %s", exc)
                continue
            try:
                agent.handle(msg)
            except Exception:  # one bad event must not end the agent
                log.exception("handling %s failed", msg.get("type"))
            if msg["type"] == "shutdown":
                break
    except KeyboardInterrupt:
        log.info("%s agent: terminated", role)
    finally:
        agent.state = AgentState.STOPPING
        try:
            agent.close()
        except Exception:
            log.exception("%s agent: close failed", role)
    return 0
