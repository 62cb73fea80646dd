"""Issue 40, item 1 (first slice): a real Spark Connect server started with the plugin on this machine,
used by Connect clients in processes of their own (tests/helpers/connect_client.py: no JVM there).

What works on Connect is checked with exact results: ``broadcast`` (the object goes from the client to
the BLOB service, a UDF on the server's executors reads it), ``add_library`` (a module from the
client's disk imported in the server's workers), ``run_once`` across two client sessions (the second
gets the first's payload, nothing runs again; the job's Spark job attributed through Connect's session
tag), ``job_results``, keyed-state batches (apply + commit) across two client sessions, and a
keyed-state stream through ``ks.process`` in ``foreachBatch`` restarted by another client. What does not
work yet is
refused at once with our error naming the call, why, and what to do instead. ``configure()`` on a
Connect builder sets nothing and says what belongs to the server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _connect_available() -> str | None:
    try:
        import grpc  # noqa: F401
        import pyspark.sql.connect.session  # noqa: F401
    except ImportError as exc:
        return f"the Spark Connect client needs pyspark[connect]'s packages: {exc}"
    return None


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    reason = _connect_available()
    if reason:
        pytest.skip(reason)
    from sparksteward.testing.connect import connect_server

    work = tmp_path_factory.mktemp("connect")
    with connect_server(work, conf={"spark.steward.state-dir": str(work / "state"),
                                    "spark.steward.agent.python": sys.executable,
                                    "spark.executor.memory": "512m"}) as url:
        yield url


def client(url: str, scenario: str, *args: str, other_host: bool = False) -> dict:
    """Run a scenario in a client process of its own; its one JSON result. ``other_host``: in a mount
    namespace of its own with a fresh /tmp and state dir and another boot id, so it shares no file with
    the server (whose state dir, with the BLOB server's incoming dir, is under /tmp)."""
    import shlex
    import uuid

    from sparksteward.testing.standalone import _namespace_script, _software_paths, isolation_unavailable

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "tests.helpers.connect_client", url, scenario, *args]
    if other_host:
        reason = isolation_unavailable()
        if reason:
            pytest.skip(f"the client cannot be another host here: {reason}")
        script = _namespace_script([os.environ.get("XDG_STATE_HOME", "/nonexistent")], str(uuid.uuid4()),
                                   f"cd {shlex.quote(str(ROOT))} && exec {shlex.join(cmd)}", keep=_software_paths())
        cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert out.returncode == 0, f"client {scenario}: {out.stderr[-4000:]}"
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    assert lines, out.stdout[-2000:] + out.stderr[-2000:]
    return json.loads(lines[-1])


def test_a_broadcast_from_a_connect_client_on_another_host_is_read_by_a_udf_on_the_servers_executors(server):
    got = client(server, "broadcast", other_host=True)
    assert got["rows"] == [[i, i * 3] for i in range(0, 100_000, 9_999)]
    assert got["driver_value"] == "triples"


def test_run_once_across_two_client_sessions_runs_once(server):
    first = client(server, "run_once", "connect-nightly-1", "42", other_host=True)
    second = client(server, "run_once", "connect-nightly-1", "7")
    # the job's Spark job was attributed to it through Connect's session tag
    assert first["payload"] == {"answer": 42, "rows": 1000} and first["ran"] == 1 and first["status"] == "SUCCEEDED"
    assert first["spark_jobs"] and set(first["spark_jobs"]) == {"succeeded"}
    assert second == {**first, "ran": 0}


def test_a_library_added_from_a_connect_client_is_importable_in_the_servers_workers(server, tmp_path):
    lib = tmp_path / "steward_connect_lib.py"
    lib.write_text("def triple(x):\n    return 3 * x\n")
    got = client(server, "library", str(lib))
    assert got["rows"] == [0, 3, 6, 9, 12] and got["key"]


def test_keyed_state_batches_from_a_connect_client_go_on_exactly_across_client_sessions(server, tmp_path):
    """apply + commit from a Connect client (the state's tasks on the server's executors, the checkpoint
    by its driver agent); a second client session opens the same state and goes on from its checkpoint."""
    chk = str(tmp_path / "chk")
    first = client(server, "keyed", chk, "0")["batches"]
    second = client(server, "keyed", chk, "2")["batches"]
    counts: dict = {}
    want = []
    for batch in range(4):
        for i in range(batch * 10, batch * 10 + 10):
            counts[f"u{i % 3}"] = counts.get(f"u{i % 3}", 0) + 1
        want.append(sorted([k, n] for k, n in counts.items()))
    assert first + second == want


def test_a_keyed_state_stream_through_foreach_batch_from_a_connect_client_restarts_exactly(server, tmp_path):
    """ks.process as a Connect foreachBatch function (it runs in a Python process of the server, where the
    pickled state and client revive): a file stream of 3 files, one per batch, then a new client process
    restarts the query over 2 more; every batch's emitted counts are exact and nothing is emitted twice."""
    import json as _json

    indir, outdir = tmp_path / "in", tmp_path / "out"
    indir.mkdir()

    def write(i):
        rows = [{"k": f"u{j % 3}", "v": j} for j in range(i * 6, i * 6 + 6)]
        (indir / f"part-{i}.json").write_text("".join(_json.dumps(r) + "\n" for r in rows))

    paths = [str(indir), str(outdir), str(tmp_path / "chk"), str(tmp_path / "qchk")]
    for i in range(3):
        write(i)
    first = client(server, "stream", *paths)["rows"]
    for i in range(3, 5):
        write(i)
    second = client(server, "stream", *paths)["rows"]
    want = [[b, f"u{k}", 2 * (b + 1)] for b in range(5) for k in range(3)]   # each file: 2 rows of each key
    assert first == want[:9]
    assert second == want   # the output dir holds both runs: the restart emitted each batch once


def test_a_file_and_a_jar_added_from_a_connect_client_reach_the_session_s_tasks(server, tmp_path):
    """Issue 40: ``add_file``/``add_jar`` on Connect upload to the BLOB service, and the server's ``ADD FILE``
    (of the steward:// URL) and ``ADD JAR`` (of the driver agent's verified copy) add them to the client's
    session: its tasks read the file with ``SparkFiles.get`` and run the jar's Java UDF."""
    from tests.helpers.jars import JAVAC, build_udf_jar

    if JAVAC is None:
        pytest.skip("no javac")
    text = tmp_path / "lookup.txt"
    text.write_text("hello from the client")
    got = client(server, "add", str(text), str(build_udf_jar(tmp_path / "jar")))
    assert got["file_url"].startswith("steward://") and got["file_url"].endswith("/lookup.txt")
    assert got["files"] == ["hello from the client"]
    assert got["jar_url"].startswith("steward://") and got["udf"] == ["0", "2", "4", "6"]


def test_what_does_not_work_on_connect_yet_is_refused_by_name(server, tmp_path):
    jar = tmp_path / "udfs.jar"
    jar.write_bytes(b"PK\x05\x06" + b"\x00" * 18)   # any file: the refusal comes before the check
    got = client(server, "refused", str(jar), str(tmp_path / "chk"))["messages"]
    for call, instead in (("keyed_state(...).process(idle_timers=...)", "Leave idle_timers out"),
                          ("read_state", "classic")):
        assert f"Steward.{call}" in got[call] and "not available on Spark Connect" in got[call], got[call]
        assert instead in got[call], got[call]
        assert got[call].startswith("ConnectNotSupportedError"), got[call]


def test_configure_on_a_connect_builder_sets_nothing_and_says_what_belongs_to_the_server():
    reason = _connect_available()
    if reason:
        pytest.skip(reason)
    import sparksteward
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.remote("sc://127.0.0.1:1")
    before = dict(builder._options)
    with pytest.warns(UserWarning, match=r"Spark Connect client: configure\(\) set nothing.*--conf "
                                         r"spark.plugins=sparksteward.shim.StewardPlugin.*--jars"):
        assert sparksteward.configure(builder) is builder
    assert builder._options == before


def test_connect_server_print_is_the_spark_submit_line_with_the_plugin(capsys):
    """``steward connect-server --print``: the jar, configure()'s settings, the port and the user's own
    spark-submit arguments, before the server's resource."""
    import shlex

    from sparksteward.cli import main
    from sparksteward.jar import shim_jar

    assert main(["connect-server", "--print", "--port", "15123", "--", "--master", "local[2]",
                 "--conf", "spark.ui.enabled=false"]) == 0
    cmd = shlex.split(capsys.readouterr().out)
    assert cmd[0].endswith("spark-submit") and cmd[-1] == "spark-internal"
    assert cmd[cmd.index("--class") + 1] == "org.apache.spark.sql.connect.service.SparkConnectServer"
    assert cmd[cmd.index("--jars") + 1] == str(shim_jar())
    confs = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--conf"]
    for want in ("spark.plugins=sparksteward.shim.StewardPlugin", "spark.python.daemon.module=sparksteward.daemon",
                 "spark.hadoop.fs.steward.impl=sparksteward.shim.StewardFileSystem",
                 "spark.connect.grpc.binding.port=15123", "spark.ui.enabled=false"):
        assert want in confs, (want, confs)
    assert cmd[cmd.index("--master") + 1] == "local[2]"


@pytest.mark.parametrize("path", ["/srv/state dir/x.jar", "x.jar' ; DROP TABLE t; --", "/tmp/x\\\\.jar"])
def test_a_path_that_cannot_be_quoted_into_add_jar_is_refused_before_any_sql(path):
    """``ADD FILE``/``ADD JAR`` get only letters, digits and ``/:._+-``: anything else (a space, a quote,
    a backslash) is refused by name before Spark sees a statement."""
    from types import SimpleNamespace

    from sparksteward import Steward
    from sparksteward.errors import InvalidIdError

    ran = []
    fake = SimpleNamespace(spark=SimpleNamespace(sql=lambda text: ran.append(text)))   # records, never runs
    with pytest.raises(InvalidIdError, match="cannot go into ADD JAR"):
        Steward._add_on_connect(fake, "ADD JAR", path)
    assert ran == []
