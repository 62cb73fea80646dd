"""Must-show 6, the HA half: an uploader of permanent blobs SIGKILLed at random points.

A real process puts permanent blobs through a BlobServer (local store from the driver agent's
``_server_dir``, HA on file:// or moto S3) and prints each key once ``put_file`` returned, i.e. once
the put is acknowledged. After every kill: each acknowledged blob is in HA and verifies; every file
under a final blob name, in HA and in the local store, verifies against its key (never empty or
partial); anything else is a staged temp name, which recovery sweeps.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from sparksteward.agents.driver import _server_dir
from sparksteward.blob.client import BlobClient
from sparksteward.blob.key import BlobKey
from sparksteward.blob.staging import unnamed_files
from sparksteward.blob.store import FileSystemBlobStore
from sparksteward.errors import StewardError
from sparksteward.hashing import hash_file
from sparksteward.testing.agent import AgentProcess

_UPLOADER = r"""
import os, random, sys
from sparksteward.agents.driver import _server_dir
from sparksteward.blob.key import BlobType
from sparksteward.blob.server import BlobServer
from sparksteward.blob.store import FileSystemBlobStore
state, ha_url, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
local = _server_dir(state)
print("LOCAL", local, flush=True)
server = BlobServer(local, FileSystemBlobStore(ha_url, "c1"), timer=False)
rnd = random.Random(seed)
for i in range(10**6):
    src = server.incoming / f"put-{i}"
    with open(src, "wb") as f:
        f.write(rnd.randbytes(rnd.randint(1, 3 << 20)))
    job = f"job-{i % 3}"
    key, _ = server.put_file(src, job, BlobType.PERMANENT, move=True)
    print("ACK", job, key, flush=True)
"""


def _kill_uploader_at_random(state: Path, ha_url: str, seed: int) -> tuple[Path, list[tuple[str, BlobKey]]]:
    rnd = random.Random(seed)
    proc = subprocess.Popen([sys.executable, "-c", _UPLOADER, str(state), ha_url, str(seed)],
                            stdout=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.readline().split()
        assert first and first[0] == "LOCAL", f"uploader did not start: {first}"
        for _ in range(rnd.randint(0, 2)):  # let some puts complete first
            assert proc.stdout.readline().startswith("ACK")
        time.sleep(rnd.uniform(0, 0.4))  # a random kill point, not a wait for an effect
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        acked = []
        # The kill can cut the last line short: only a whole line ("ACK job key\n") is an acknowledgement.
        for line in proc.stdout.read().split("\n")[:-1]:
            _, job, key = line.split()
            acked.append((job, BlobKey.parse(key)))
        return Path(first[1]), acked
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def _check_final_names(files: list[tuple[str, int]], what: str) -> int:
    """Every blob-named file verifies and is non-empty; return how many staged names there are."""
    staged = 0
    for path, size in files:
        name = os.path.basename(path)
        try:
            key = BlobKey.parse(name)
        except ValueError:
            assert name.endswith(".tmp") or name == "owner.json" or name.startswith("put-"), \
                f"unexpected file {path} in {what}"
            staged += name.endswith(".tmp")
            continue
        assert size > 0, f"empty file under the final name {path} in {what}"
        assert hash_file(path) == key.digest, f"partial or corrupt file under the final name {path} in {what}"
    return staged


def _local_files(root: Path) -> list[tuple[str, int]]:
    return [(str(p), p.stat().st_size) for p in root.rglob("*") if p.is_file()]


def test_sigkill_during_file_ha_uploads(tmp_path):
    ha = FileSystemBlobStore(str(tmp_path / "ha"), "c1")
    state = tmp_path / "state"
    acked_total, staged_seen, stores, run = 0, 0, [], 0
    while run < 12 or (acked_total < 12 and run < 36):   # as the S3 test below: enough puts, however loaded
        local, acked = _kill_uploader_at_random(state, str(tmp_path / "ha"), seed=run)
        run += 1
        stores.append(local)
        for job, key in acked:
            assert ha.get(job, key, tmp_path / "check") > 0, f"acknowledged {key} of {job} is lost"
        staged_seen += _check_final_names(_local_files(Path(ha.base.root)), "the HA store")
        _check_final_names(_local_files(local), "the local store")
        acked_total += len(acked)
    assert acked_total >= 12
    # recovery: staged HA files are swept, and so are the dead uploaders' local stores
    ha.sweep_staged(max_age=0)
    assert not [p for p, _ in _local_files(Path(ha.base.root)) if p.endswith(".tmp")]
    fresh = Path(_server_dir(str(state)))
    assert not [s for s in stores if s.exists()], "the dead uploaders' local stores were swept"
    assert fresh.exists()
    print(f"{acked_total} acknowledged puts over {run} kills; {staged_seen} staged HA files seen after kills")


def test_sigkill_during_s3_ha_uploads(tmp_path, s3):
    url = s3.url("crash")
    ha = FileSystemBlobStore(url, "c1")
    fs = s3.filesystem()
    acked_total, run = 0, 0
    # at least 10 kills and 10 acknowledged puts (a loaded machine acknowledges fewer before a kill), at most 30
    while run < 10 or (acked_total < 10 and run < 30):
        _, acked = _kill_uploader_at_random(tmp_path / "state", url, seed=100 + run)
        run += 1
        for job, key in acked:
            assert ha.get(job, key, tmp_path / "check") > 0, f"acknowledged {key} of {job} is lost"
        objects = [(p, int(info["size"])) for p, info in fs.find(ha.base.root, detail=True).items()]
        for path, size in objects:
            key = BlobKey.parse(os.path.basename(path))  # never a staged name on S3
            assert size > 0
            ha.get(path.split("/")[-2], key, tmp_path / "obj")  # verifies
        acked_total += len(acked)
    assert acked_total >= 10


def _put_until_killed(client: BlobClient, agent: AgentProcess, rnd: random.Random) -> list[tuple[str, BlobKey, bytes, bool]]:
    """Stream puts of random sizes and types into the agent until a timer SIGKILLs it at a random
    point; return the acknowledged ones (a put that raised may or may not have landed)."""
    acked: list[tuple[str, BlobKey, bytes, bool]] = []
    killer = threading.Timer(rnd.uniform(0.05, 0.6), agent.kill)
    killer.start()
    try:
        for i in range(10**6):
            size = rnd.choice([1, 100, 4096, 60_000, rnd.randint(1, 3 << 20)])
            data, permanent, job = rnd.randbytes(size), rnd.random() < 0.5, f"job-{i % 3}"
            try:
                key = client.put_bytes(data, job, permanent=permanent)
            except (OSError, StewardError):
                return acked
            acked.append((job, key, data, permanent))
    finally:
        killer.join()
    raise AssertionError("the agent was never killed")


def test_a_driver_agent_killed_during_streamed_puts_leaks_nothing_and_its_restart_serves_every_acked_permanent_blob(
        tmp_path):
    """Streamed puts land in staged files the agent makes ahead (unnamed where the kernel allows).
    A seeded run SIGKILLs a real driver agent at random points while a client streams puts of 1 B to
    3 MiB. After each kill, every file under a blob's name in its local store verifies and no staged
    file is left to sweep where staging is unnamed; the next agent on the same state dir sweeps the
    dead store and serves every acknowledged permanent blob (from HA) with its bytes."""
    seed = int(os.environ.get("STEWARD_SEED", time.time_ns() % 1_000_000))
    print(f"seed {seed} (STEWARD_SEED={seed} repeats this run)")
    rnd = random.Random(seed)
    conf = {"spark.steward.state-dir": str(tmp_path / "state"),
            "spark.steward.blob.ha.storage-path": str(tmp_path / "ha")}
    root = tmp_path / "state" / "blob-local"
    unnamed = unnamed_files(Path(tempfile.mkdtemp(dir=tmp_path)))
    permanent: list[tuple[str, BlobKey, bytes]] = []
    total = 0
    for run in range(5):
        agent = AgentProcess("driver", conf, stderr=subprocess.DEVNULL)
        try:
            assert agent.ready, agent.first
            others = [d for d in root.iterdir()
                      if d.name.startswith("server-") and not d.name.startswith(f"server-{agent.proc.pid}-")]
            assert not others, f"run {run}: the killed agents' stores were not swept: {others}"
            conn = agent.connect()
            client = BlobClient(lambda c=conn: c)
            for job, key, data in permanent:  # every acknowledged permanent blob so far, from HA
                assert client.get_bytes(key, job) == data, f"run {run}: {key} of {job} came back different"
            acked = _put_until_killed(client, agent, rnd)
            conn.close()
        finally:
            agent.kill()
            agent.proc.stdout.close()
        stores = [d for d in root.iterdir() if d.name.startswith("server-")]
        assert len(stores) == 1, stores
        staged = _check_final_names(_local_files(stores[0]), "the killed agent's local store")
        if unnamed:
            assert staged == 0, "unnamed staged files leave nothing behind a killed agent"
        permanent += [(job, key, data) for job, key, data, perm in acked if perm]
        total += len(acked)
    assert total >= 5 and permanent, f"too few acknowledged puts to mean anything: {total}"
    print(f"{total} acknowledged puts over 5 kills, {len(permanent)} permanent; unnamed staging: {unnamed}")
