"""Run a real agent process without Spark: the test plays the shim's part on its stdin and stdout.

Used by the agent, protocol and crash tests. The process is real, so it can be SIGKILLed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from typing import Any

import orjson

from sparksteward import shim_protocol
from sparksteward.wire import Connection, new_secret

__all__ = ["AgentProcess"]


class AgentProcess:
    """A driver or executor agent started with a hand-made ``hello``; its stderr goes to ``stderr`` (a
    file), by default to the test's own."""

    def __init__(self, role: str, conf: dict[str, str] | None = None, *, secret: str | None = None,
                 port: int = 0, rendezvous_dir: str | None = None, driver_endpoint: str | None = None,
                 env: dict[str, str] | None = None, stderr: Any = None) -> None:
        self.role = role
        self.secret = secret or new_secret()
        self.hello = {"v": 1, "type": "hello", "role": role, "executor_id": "driver" if role == "driver" else "1",
                      "host": "127.0.0.1", "bind_host": "127.0.0.1", "port": port,
                      "driver_endpoint": driver_endpoint, "rendezvous_dir": rendezvous_dir,
                      "secret": self.secret, "conf": dict(conf or {})}
        # an executor's working dir is its own (a log file may go there): the rendezvous dir, as Spark's
        # executors run in their work dir
        near = [rendezvous_dir, os.path.dirname(rendezvous_dir)] if rendezvous_dir else []
        cwd = next((d for d in near if d and os.path.isdir(d)), None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", f"sparksteward.agents.{role}"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=stderr, env={**os.environ, **(env or {})}, cwd=cwd)
        self.send(self.hello)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        self.first: dict[str, Any] = shim_protocol.decode(line) if line else {"type": "eof"}
        self.endpoint: str | None = self.first.get("endpoint")

    @property
    def ready(self) -> bool:
        return self.first.get("type") == "ready"

    def send(self, msg: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(orjson.dumps(msg) + b"\n")
        self.proc.stdin.flush()

    def event(self, kind: str, **fields: Any) -> None:
        self.send({"v": 1, "type": kind, "time": int(time.time() * 1000), **fields})

    def connect(self, secret: str | None = None) -> Connection:
        assert self.endpoint, f"agent did not start: {self.first}"
        return Connection.connect(self.endpoint, secret or self.secret, timeout=30)

    def close_stdin(self) -> None:
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self, timeout: float = 30) -> int:
        """Send shutdown, close stdin, wait for exit; kill if it does not exit in time."""
        if self.proc.poll() is None:
            with contextlib.suppress(BrokenPipeError, ValueError):
                self.event("shutdown", reason="test")
            self.close_stdin()
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.wait(10)

    def __enter__(self) -> AgentProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        if self.proc.stdout:
            self.proc.stdout.close()
