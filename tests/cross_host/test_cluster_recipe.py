"""docs/deployment.md's recipe, run as written (issue 40, must-show 3): ``steward jar``, then
``spark-submit`` of examples/cluster_app.py to a Spark standalone cluster whose worker is another
"host" (its own mount namespace: it sees neither the driver's files nor its boot id), with the state on
S3 (moto's server). A second submit goes on from the first one's state. Its own cluster and bucket: the
folder's session must not hold the worker's core."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sparksteward.testing.standalone import isolation_unavailable, standalone_cluster

from tests.helpers.s3 import new_bucket

pytestmark = [pytest.mark.slow, pytest.mark.soak]   # two submits and a cluster: a minute and a half

ROOT = Path(__file__).resolve().parents[2]


def _submit(cluster, jar, s3, state_dir, batches):
    submit = Path(sys.executable).parent / "spark-submit"
    cmd = [str(submit), "--master", cluster.master_url,
           "--conf", "spark.plugins=sparksteward.shim.StewardPlugin", "--jars", jar,
           "--conf", f"spark.steward.checkpoint.dir={s3.url('checkpoints')}",
           "--conf", f"spark.steward.storage.options={s3.storage_options()}",
           "--conf", "spark.executor.memory=512m", "--conf", "spark.executor.cores=1", "--conf", "spark.cores.max=1",
           # this machine's Python with spark-steward importable; a cluster image that installs it needs none
           "--conf", f"spark.pyspark.python={sys.executable}", "--conf", f"spark.steward.agent.python={sys.executable}",
           "--conf", f"spark.executorEnv.PYTHONPATH={os.environ['PYTHONPATH']}",
           "--conf", f"spark.steward.state-dir={state_dir}", "--conf", "spark.ui.enabled=false",
           str(ROOT / "examples" / "cluster_app.py"), str(batches)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=os.environ)
    assert out.returncode == 0, out.stderr[-4000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def test_the_guides_recipe_submits_to_another_host_with_state_on_s3(tmp_path, s3_server):
    reason = isolation_unavailable()
    if reason:
        pytest.skip(f"cross-host test: the worker cannot get its own mount namespace here: {reason}")
    jar = subprocess.run([sys.executable, "-m", "sparksteward", "jar"], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert jar.endswith(".jar") and Path(jar).is_file()
    s3 = new_bucket(s3_server)
    hide = [os.environ["XDG_STATE_HOME"]]
    with standalone_cluster(tmp_path / "standalone", hide=hide,
                            worker_env={"PYTHONPATH": os.environ["PYTHONPATH"], "PYSPARK_PYTHON": sys.executable}) as c:
        first = _submit(c, jar, s3, tmp_path / "driver-state", 3)
        second = _submit(c, jar, s3, tmp_path / "driver-state-2", 2)
    assert [r["batch"] for r in first if "batch" in r] == [0, 1, 2]
    assert [r["clicks"] for r in first if "batch" in r] == [1000, 2000, 3000]
    assert [(r["batch"], r["clicks"]) for r in second if "batch" in r] == [(3, 4000), (4, 5000)]   # went on
    rss = next(r["agents_rss_mb"] for r in second if "agents_rss_mb" in r)
    print("agents' resident memory (MB):", rss)
    assert any(k.startswith("driver") for k in rss) and any(k.startswith("executor") for k in rss)
