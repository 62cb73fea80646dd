"""A real Spark standalone cluster for tests, with a worker that plays "another host".

``with standalone_cluster(work_dir) as cluster:`` starts a Master on 127.0.0.1 and one Worker, and
yields :class:`StandaloneCluster` (``cluster.master_url`` for ``SparkSession.builder.master``).
``workers=n`` starts n Workers, worker i on the loopback address ``127.0.0.<i+1>``: Spark sees n hosts
(a speculative copy of a task, for one, never runs on the host of its original).

With ``isolated=True`` each Worker (and so its executors, their Python workers and spark-steward's
executor agents) runs in its own mount namespace (``unshare --mount --propagation private``) where

- ``/tmp`` is a fresh tmpfs, and so is every directory in ``hide`` (e.g. the spark-steward state dir),
  so the executor sees none of the driver's files there; only the installed software (this checkout,
  the Python environment, Spark) stays visible where it lives under /tmp, as on any real host;
- ``/proc/sys/kernel/random/boot_id`` is a bind mount of a file holding another uuid, so the executor
  believes it runs under another kernel (each isolated Worker its own).

The network is shared (everything talks over 127.0.0.1). That needs root (or ``CAP_SYS_ADMIN``);
:func:`isolation_unavailable` probes once and returns why it cannot work here, or ``None``.

Every process runs in its own process group, which :meth:`StandaloneCluster.close` terminates and
then kills, so no JVM, Python worker or agent outlives the cluster.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

__all__ = ["StandaloneCluster", "isolation_unavailable", "spark_home", "standalone_cluster"]

_MASTER = "org.apache.spark.deploy.master.Master"
_WORKER = "org.apache.spark.deploy.worker.Worker"


def spark_home() -> Path:
    """``$SPARK_HOME``, else the installed pyspark's directory (it has ``bin/`` and ``jars/``)."""
    if os.environ.get("SPARK_HOME"):
        return Path(os.environ["SPARK_HOME"])
    import pyspark

    return Path(pyspark.__file__).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _software_paths() -> list[str]:
    """Paths under /tmp that hold the software every host has installed (this checkout's code, the
    Python environment, Spark): a CI checkout or a venv may live under /tmp, and the "other host" must
    still run the same installed software. The driver's files there stay hidden."""
    import sparksteward

    candidates = [str(spark_home()), sys.prefix, os.path.dirname(os.path.realpath(sys.executable)),
                  str(Path(sparksteward.__file__).resolve().parents[2]),
                  *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    under_tmp = sorted({os.path.realpath(c) for c in candidates if os.path.realpath(c).startswith("/tmp/")})
    return [c for c in under_tmp if not any(c.startswith(o + "/") for o in under_tmp if o != c)]


def _namespace_script(hide: Sequence[str], boot_id: str, then: str, keep: Sequence[str] = ()) -> str:
    """The shell run inside the new mount namespace: tmpfs over /tmp and ``hide``, fake boot id, then ``then``.

    Each path in ``keep`` (under /tmp) is bind-mounted through a private staging tmpfs back to the same
    path on the new /tmp, so installed software stays visible while everything else under /tmp goes."""
    lines = ["set -e"]
    if keep:
        lines.append("mount -t tmpfs -o mode=0700 tmpfs /mnt")
        lines += [f"mkdir -p /mnt/keep{i} && mount --bind {shlex.quote(k)} /mnt/keep{i}" for i, k in enumerate(keep)]
    lines.append("mount -t tmpfs -o mode=1777 tmpfs /tmp")
    lines += [f"mkdir -p {shlex.quote(k)} && mount --bind /mnt/keep{i} {shlex.quote(k)}" for i, k in enumerate(keep)]
    for d in hide:
        if not os.path.realpath(d).startswith("/tmp/") and os.path.isdir(d):
            lines.append(f"mount -t tmpfs -o mode=0755 tmpfs {shlex.quote(d)}")
    lines += [f"printf '%s\\n' {shlex.quote(boot_id)} > /tmp/.steward-boot-id",
              "mount --bind /tmp/.steward-boot-id /proc/sys/kernel/random/boot_id",
              then]
    return "\n".join(lines)


@functools.lru_cache(maxsize=1)
def isolation_unavailable() -> str | None:
    """Why a worker cannot get its own mount namespace here (``None`` when it can). Probes once."""
    if os.geteuid() != 0:
        return f"needs root for unshare --mount and tmpfs/bind mounts (running as uid {os.geteuid()})"
    probe_id = str(uuid.uuid4())
    script = _namespace_script([], probe_id, "exec cat /proc/sys/kernel/random/boot_id")
    try:
        out = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                             capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        return "the `unshare` command is missing (util-linux)"
    except subprocess.TimeoutExpired:
        return "the unshare --mount probe did not finish within 30 s"
    if out.returncode != 0:
        return (f"the probe `unshare --mount --propagation private` + tmpfs + boot_id bind failed with "
                f"exit code {out.returncode}: {out.stderr.strip()[:500]}")
    if out.stdout.strip() != probe_id:
        return f"the probe's boot_id bind did not take effect (read {out.stdout.strip()!r})"
    return None


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


class StandaloneCluster:
    """A Spark standalone Master and one Worker. See the module docstring. ``close`` is idempotent."""

    def __init__(self, work_dir: str | os.PathLike[str], *, isolated: bool = True, hide: Sequence[str] = (),
                 worker_boot_id: str | None = None, worker_env: dict[str, str] | None = None,
                 cores: int = 1, memory: str = "1g", start_timeout: float = 60.0, workers: int = 1) -> None:
        if not 1 <= workers <= 250:
            raise ValueError(f"workers={workers}: give 1 to 250 (worker i listens on 127.0.0.<i+1>)")
        self.work_dir = Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.isolated = isolated
        self.worker_boot_id = worker_boot_id or str(uuid.uuid4())
        self.port, self.webui_port = _free_port(), _free_port()
        self.master_url = f"spark://127.0.0.1:{self.port}"
        self._procs: list[subprocess.Popen[bytes]] = []
        self._closed = False
        home = spark_home()
        env = {**os.environ, "SPARK_HOME": str(home), "SPARK_LOCAL_IP": "127.0.0.1",
               "SPARK_NO_DAEMONIZE": "1", "SPARK_DAEMON_MEMORY": "512m",
               "SPARK_MASTER_OPTS": "-Dspark.master.rest.enabled=false"}
        spark_class = str(home / "bin" / "spark-class")
        try:
            self._start(env, [spark_class, _MASTER, "--host", "127.0.0.1", "--port", str(self.port),
                              "--webui-port", str(self.webui_port)], "master")
            self._wait(lambda: _get_json(self.webui + "/json/").get("status") == "ALIVE", start_timeout,
                       "the standalone master")
            for i in range(workers):
                self._start_worker(i, env, spark_class, worker_env, hide, cores, memory)
            self._wait(lambda: sum(w.get("state") == "ALIVE" for w in _get_json(self.webui + "/json/")["workers"])
                       >= workers, start_timeout, f"{workers} worker(s) to register with the master")
        except BaseException:
            self.close()
            raise

    def _start_worker(self, i: int, env: dict[str, str], spark_class: str, worker_env: dict[str, str] | None,
                      hide: Sequence[str], cores: int, memory: str) -> None:
        host = f"127.0.0.{i + 1}"
        worker = [spark_class, _WORKER, self.master_url, "--host", host, "--cores", str(cores),
                  "--memory", memory, "--webui-port", str(_free_port())]
        wenv = {**env, "SPARK_LOCAL_IP": host, **(worker_env or {})}
        name = "worker" if i == 0 else f"worker{i}"
        if self.isolated:
            unavailable = isolation_unavailable()
            if unavailable:
                raise RuntimeError(f"cannot isolate the worker: {unavailable}")
            work = "/tmp/work"
            boot_id = self.worker_boot_id if i == 0 else str(uuid.uuid4())
            script = _namespace_script(list(hide), boot_id,
                                       f"mkdir -p {work} && exec " + shlex.join([*worker, "--work-dir", work]),
                                       keep=_software_paths())
            cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script]
        else:
            cmd = [*worker, "--work-dir", str(self.work_dir / name)]
        self._start(wenv, cmd, name)

    @property
    def webui(self) -> str:
        return f"http://127.0.0.1:{self.webui_port}"

    def _start(self, env: dict[str, str], cmd: list[str], name: str) -> None:
        log = open(self.work_dir / f"{name}.log", "ab")  # the child owns it
        with log:
            self._procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                                stderr=subprocess.STDOUT, start_new_session=True))

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while True:
            for p in self._procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{what}: a process exited with code {p.returncode}; "
                                       f"see the logs in {self.work_dir}:\n{self.logs()[-3000:]}")
            with contextlib.suppress(OSError, ValueError, KeyError):
                if ready():
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {timeout}s waiting for {what}; logs in {self.work_dir}:\n"
                                   f"{self.logs()[-3000:]}")
            time.sleep(0.2)

    def logs(self) -> str:
        return "".join(f"--- {p.name}\n{p.read_text(errors='replace')}" for p in sorted(self.work_dir.glob("*.log")))

    def applications(self) -> dict:
        """The master's JSON status (``activeapps``, ``completedapps``, ``workers``)."""
        return _get_json(self.webui + "/json/")

    def close(self, grace: float = 10.0) -> None:
        """Stop the worker (its whole process group: executors, Python workers, agents), then the master."""
        if self._closed:
            return
        self._closed = True
        for p in reversed(self._procs):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(grace)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)  # whatever the JVM left in its group
            p.wait()

    def __enter__(self) -> StandaloneCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def standalone_cluster(work_dir: str | os.PathLike[str], **kw) -> Iterator[StandaloneCluster]:
    """Start a :class:`StandaloneCluster` for the block and stop every process of it afterwards."""
    cluster = StandaloneCluster(work_dir, **kw)
    try:
        yield cluster
    finally:
        cluster.close()
