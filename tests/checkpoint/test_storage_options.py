"""``spark.steward.storage.options`` is honoured by every process that opens a store: the agents, the
user's driver (``ks.read()``), the Python tasks of ``ks.read(distributed=True)`` and the ``steward``
command (``--conf spark.steward.storage.options=...``), with no S3 endpoint in any environment.

The Spark test runs its driver as a child process (:mod:`tests.helpers.storage_options_driver`) with the
``AWS_ENDPOINT_URL*`` variables removed, so its JVM, executor, agents and Python workers never see the
moto endpoint this session exports; requests that miss the options would go to AWS (whose hosts do not
resolve here) and fail. Run under the Spark lock."""

from __future__ import annotations

import os
import subprocess
import sys

import orjson
import pytest
from sparksteward.cli import main
from sparksteward.config import parse_setting
from sparksteward.errors import ConfigError
from sparksteward.storage import OPTIONS_KEY, open_location, options_scope

from tests.helpers import REPO
from tests.helpers.keyed import make_batches, reference

CLUSTER, NAME, SEED = "so", "opts", 22   # those of tests/helpers/storage_options_driver.py


def _env_without_endpoint(**extra: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("AWS_ENDPOINT_URL")}, **extra}


def _steward(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sparksteward", *args], env=_env_without_endpoint(), cwd=REPO,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
@pytest.mark.soak   # its own driver process, 67 s: make soak
def test_a_keyed_state_on_s3_reads_back_everywhere_with_the_endpoint_only_in_the_options(s3, tmp_path):
    chk = s3.url("chk")
    opts = s3.storage_options()
    child = subprocess.run(
        [sys.executable, "-m", "tests.helpers.storage_options_driver", str(tmp_path / "result.json"), chk,
         str(tmp_path / "state")],
        env=_env_without_endpoint(STEWARD_TEST_STORAGE_OPTIONS=opts), cwd=REPO, capture_output=True, text=True,
        timeout=400)
    assert child.returncode == 0, child.stderr[-6000:]
    result = orjson.loads((tmp_path / "result.json").read_bytes())
    assert result["executor_env"] == []          # the executor's Python workers had no endpoint either
    want = {k: list(v) for k, v in reference(make_batches(SEED, count=2, rows=200, keys=20)).items()}
    assert result["local"] == want
    assert result["distributed"] == want

    conf = ["--cluster-id", CLUSTER, "--conf", f"{OPTIONS_KEY}={opts}"]
    ls = _steward("checkpoints", "ls", chk, *conf)
    assert ls.returncode == 0, ls.stderr
    assert "1 state(s)" in ls.stdout and NAME in ls.stdout
    show = _steward("checkpoints", "show", chk, NAME, "--json", *conf)
    assert show.returncode == 0, show.stderr
    assert orjson.loads(show.stdout)["checkpoint_id"] == 1
    read = _steward("checkpoints", "read", chk, NAME, "--json", "--limit", "1000", *conf)
    assert read.returncode == 0, read.stderr
    rows = [orjson.loads(line) for line in read.stdout.splitlines()]
    assert {r["key"]: [orjson.loads(r["value"])["n"], orjson.loads(r["value"])["s"]] for r in rows} == want


def test_the_cli_refuses_bad_options_naming_the_key_and_never_the_value(tmp_path, capsys):
    secret = "s3cr3t-never-printed"
    bad = {f'{{"s3": {{"secret": "{secret}"': "not valid JSON",
           f'["{secret}"]': "a JSON object",
           f'{{"s3": "{secret}"}}': "a JSON object"}
    for raw, why in bad.items():
        assert main(["checkpoints", "ls", str(tmp_path), "--conf", f"{OPTIONS_KEY}={raw}"]) == 2
        err = capsys.readouterr().err
        assert OPTIONS_KEY in err and why in err and secret not in err, err
    assert main(["jobs", "list", "--path", str(tmp_path), "--conf", "spark.steward.cluster-id=x"]) == 2
    err = capsys.readouterr().err
    assert "spark.steward.cluster-id" in err and "--cluster-id" in err, err
    assert main(["checkpoints", "ls", str(tmp_path), "--conf", "no-equals-sign"]) == 2
    assert "KEY=VALUE" in capsys.readouterr().err


def test_bad_options_name_the_key_and_the_fix_and_never_echo_the_value():
    assert parse_setting(OPTIONS_KEY, None) == {}
    assert parse_setting(OPTIONS_KEY, '{"s3": {"anon": true}}') == {"s3": {"anon": True}}
    for bad, why in (('{"s3": {"secret": "hunter2"', "not valid JSON"), ('["hunter2"]', "a JSON list, not a JSON object"),
                     ('{"s3": "hunter2"}', "the value of 's3' is a JSON str")):
        with pytest.raises(ConfigError, match=f"{OPTIONS_KEY}=.*{why}.*expected a JSON object of objects.*Fix the value") \
                as info:
            parse_setting(OPTIONS_KEY, bad)
        assert "hunter2" not in str(info.value)


def test_an_options_scope_applies_to_opens_in_its_context_only(s3, monkeypatch):
    for k in [k for k in os.environ if k.startswith("AWS_ENDPOINT_URL")]:
        monkeypatch.delenv(k)
    opts = parse_setting(OPTIONS_KEY, s3.storage_options())
    s3.filesystem().pipe_file(f"{s3.bucket}/scoped/x", b"1")
    with options_scope(opts):
        loc = open_location(s3.url("scoped"))
        assert loc.read_bytes(loc.path("x")) == b"1"
    assert "client_kwargs" not in open_location(s3.url("scoped")).fs.storage_options


def test_a_streamed_duplicate_reads_its_source_with_the_options(s3, tmp_path, monkeypatch):
    import s3fs
    from sparksteward.checkpoint.duplicate import Duplicator

    for k in [k for k in os.environ if k.startswith("AWS_ENDPOINT_URL")]:
        monkeypatch.delenv(k)
    s3fs.S3FileSystem.clear_instance_cache()   # none made with the endpoint of the environment
    s3.filesystem().pipe_file(f"{s3.bucket}/dup/f.sst", b"payload")
    with options_scope(parse_setting(OPTIONS_KEY, s3.storage_options())):
        Duplicator().duplicate([(s3.url("dup", "f.sst"), str(tmp_path / "f.sst"))])
    assert (tmp_path / "f.sst").read_bytes() == b"payload"
