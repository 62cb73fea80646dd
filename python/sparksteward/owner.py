"""Owner files: which process on which host owns a local directory, and whether it is provably dead.

Agents keep private local directories (the driver's local blob store, each executor's cache). An
agent killed with SIGKILL cannot delete its own, so the next agent on the same host sweeps them; it
must never delete a directory whose owner may still be alive, such as another host's store on a
shared home directory, or any store on a system without ``/proc``. Each such directory therefore
holds an ``owner.json`` (versioned JSON, mode 0600)::

    {"version": 1, "hostname": ..., "boot_id": ..., "pid_ns": ..., "pid": ..., "start_time": ...}

:meth:`OwnerRecord.is_dead` is True only when the owner is proven gone: the record names this
host (same hostname) and either the kernel has rebooted since (another boot id) or, in the same pid
namespace (containers sharing a host name and a volume see different pids), the pid is not running
(``os.kill(pid, 0)`` semantics, which work without ``/proc``) or is running with another start time
(the pid was reused). Unknown means alive.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import socket
import stat
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import orjson

from sparksteward.errors import CorruptRecordError

log = logging.getLogger("sparksteward.owner")

__all__ = ["OWNER_FILE", "OwnerRecord", "boot_id", "owned_dir_is_dead", "private_dir", "process_start_time",
           "sweep_dead"]

OWNER_FILE = "owner.json"
_VERSION = 1


def boot_id() -> str:
    """This kernel's boot id (Linux), else ``""``."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def pid_namespace() -> str:
    """This process's pid namespace (``pid:[4026531836]`` on Linux), else ``""``."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def process_start_time(pid: int) -> float | None:
    """A stable start time of process ``pid`` (None if unknown or not running).

    Linux: the ``starttime`` field of ``/proc/<pid>/stat`` (clock ticks since boot). Elsewhere
    psutil's ``create_time`` if psutil is installed.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        # the command name is in parentheses and may contain spaces: split after the last ')'
        return float(stat[stat.rindex(b")") + 2:].split()[19])
    except FileNotFoundError:
        if os.path.isdir("/proc/self"):
            return None  # /proc exists, so the process does not
    except (OSError, ValueError, IndexError):
        return None
    try:
        import psutil
    except ImportError:
        return None
    try:
        return float(psutil.Process(pid).create_time())
    except Exception:  # noqa: BLE001 - NoSuchProcess, AccessDenied, ...
        return None


def _pid_running(pid: int) -> bool:
    """``os.kill(pid, 0)``: True if a process with this pid exists (even another user's)."""
    if pid <= 0:
        return True  # never probe process groups; unknown counts as alive
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError as exc:
        return exc.errno != errno.ESRCH
    return True


@dataclass(frozen=True, slots=True)
class OwnerRecord:
    """The owner of a local directory: host (hostname + boot id) and process (pid + start time)."""

    hostname: str
    boot_id: str
    pid: int
    start_time: float | None
    pid_ns: str = ""

    def __post_init__(self) -> None:
        if not all(isinstance(v, str) for v in (self.hostname, self.boot_id, self.pid_ns)):
            raise ValueError("hostname, boot_id and pid_ns must be strings")
        if not isinstance(self.pid, int) or isinstance(self.pid, bool) or self.pid <= 0:
            raise ValueError(f"pid must be a positive integer, not {self.pid!r}")
        if self.start_time is not None and not isinstance(self.start_time, (int, float)):
            raise ValueError(f"start_time must be a number or null, not {self.start_time!r}")

    @classmethod
    def current(cls) -> OwnerRecord:
        pid = os.getpid()
        return cls(socket.gethostname(), boot_id(), pid, process_start_time(pid), pid_namespace())

    def to_json(self) -> bytes:
        return orjson.dumps({"version": _VERSION, **asdict(self)})

    @classmethod
    def from_json(cls, data: bytes, source: str) -> OwnerRecord:
        try:
            rec = orjson.loads(data)
            if not isinstance(rec, dict) or rec.get("version") != _VERSION:
                raise ValueError(f"unknown version {rec.get('version') if isinstance(rec, dict) else rec!r}")
            return cls(rec["hostname"], rec["boot_id"], rec["pid"], rec["start_time"], rec.get("pid_ns", ""))
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise CorruptRecordError(f"owner file {source} is unreadable: {exc}") from exc

    # --- files -------------------------------------------------------------------------------
    def write(self, directory: str | os.PathLike[str]) -> None:
        """Write ``owner.json`` into ``directory`` (staged, 0600, never through a symlink)."""
        d = Path(directory)
        tmp = d / f".{OWNER_FILE}.{uuid.uuid4().hex[:12]}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(self.to_json())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, d / OWNER_FILE)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    @classmethod
    def read(cls, directory: str | os.PathLike[str]) -> OwnerRecord | None:
        """The owner recorded in ``directory``; None if there is no owner file."""
        path = Path(directory) / OWNER_FILE
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise CorruptRecordError(f"owner file {path} cannot be opened: {exc}") from exc
        with os.fdopen(fd, "rb") as f:
            return cls.from_json(f.read(1 << 16), str(path))

    # --- liveness ----------------------------------------------------------------------------
    def is_dead(self) -> bool:
        """True only if the owner is proven gone (see the module docstring)."""
        if self.hostname != socket.gethostname():
            return False  # another host, e.g. on a shared home dir: never ours to judge
        current_boot = boot_id()
        if self.boot_id and current_boot and self.boot_id != current_boot:
            return True  # this host rebooted since: every process of that boot is gone
        current_ns = pid_namespace()
        if self.pid_ns != current_ns:
            return False  # another container (or unknown): its pids mean nothing here
        if not _pid_running(self.pid):
            return True
        if self.start_time is None:
            return False
        now = process_start_time(self.pid)
        return now is not None and now != self.start_time  # the pid was reused by another process


def private_dir(path: Path) -> Path:
    """Create ``path`` (and missing parents) and make it 0700; refuse a symlink, a non-directory or
    another user's directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)  # no TOCTOU: check and chmod the directory we opened
    except OSError as exc:
        raise NotADirectoryError(f"{path} is a symlink or not a directory; refusing to use it as a "
                                 f"private dir ({exc.strerror})") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISDIR(st.st_mode):
            raise NotADirectoryError(f"{path} is not a directory; refusing to use it as a private dir")
        if hasattr(os, "getuid") and st.st_uid != os.getuid():
            raise PermissionError(f"{path} belongs to uid {st.st_uid}, not to this user ({os.getuid()}); "
                                  f"refusing to use it as a private dir")
        os.fchmod(fd, 0o700)  # mkdir's mode is masked by the umask, and the dir may have existed
    finally:
        os.close(fd)
    return path


def owned_dir_is_dead(directory: str | os.PathLike[str]) -> bool:
    """True if ``directory`` has an owner file whose owner is proven dead; False when unsure."""
    try:
        owner = OwnerRecord.read(directory)
    except CorruptRecordError:
        return False
    return owner is not None and owner.is_dead()


def sweep_dead(parent: Path, prefix: str, keep: Path | None = None) -> list[Path]:
    """Delete the ``<prefix>*`` dirs under ``parent`` whose owner file names a process proven dead on
    this host (a killed or restarted agent's cache or state dir); return them. Dirs without an owner
    file, symlinks and ``keep`` stay."""
    swept: list[Path] = []
    try:
        entries = list(parent.iterdir())
    except FileNotFoundError:
        return swept
    for d in entries:
        if not d.name.startswith(prefix) or (keep is not None and d == keep):
            continue
        if not d.is_symlink() and d.is_dir() and owned_dir_is_dead(d):
            shutil.rmtree(d, ignore_errors=True)
            swept.append(d)
    if swept:
        log.info("swept %d dir(s) of dead agents under %s: %s", len(swept), parent, ", ".join(d.name for d in swept))
    return swept
