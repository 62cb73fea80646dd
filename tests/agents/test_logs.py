"""Agent logs follow Spark's convention: WARNING and above on stderr (``spark.steward.log.level``,
``SPARK_STEWARD_LOG_LEVEL``), INFO and above in the agent's own rotated log file, which health names."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
from sparksteward.agents.logs import log_file_name
from sparksteward.checkpoint.storage import CheckpointStorage
from sparksteward.checkpoint.task.cache import LocalFileCache
from sparksteward.checkpoint.task.subtask_restore import rebuild_subtask
from sparksteward.errors import StewardError
from sparksteward.state.backend import RocksDBStateBackend
from sparksteward.state.keygroups import key_group, key_group_range
from sparksteward.testing.agent import AgentProcess

from tests.helpers.state import checkpoint_backends


def _run(tmp_path: Path, role: str = "driver", conf: dict[str, str] | None = None,
         env: dict[str, str] | None = None, **kw) -> tuple[dict, str]:
    """Start an agent, ask its health, stop it; return the health and what it wrote on stderr."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    if role == "executor":   # the driver's host: its state dir exists (else the log goes to the cwd)
        (tmp_path / "state").mkdir(exist_ok=True)
    err = tmp_path / f"{role}.stderr"
    with err.open("wb") as out:
        agent = AgentProcess(role, {"spark.steward.state-dir": str(tmp_path / "state"), **(conf or {})},
                             env={"SPARK_STEWARD_LOG_LEVEL": "", **(env or {})}, stderr=out, **kw)
        with agent:
            assert agent.ready, agent.first
            with agent.connect() as conn:
                health = conn.request("health")
            assert agent.stop() == 0
    return health, err.read_text()


def test_stderr_is_quiet_and_the_log_file_has_the_info_lines(tmp_path):
    health, stderr = _run(tmp_path)
    assert stderr == ""
    path = Path(health["log_file"])
    assert path == tmp_path / "state" / "logs" / "driver-agent.log"
    text = path.read_text()
    assert f" {health['pid']} INFO sparksteward.agents: driver agent {health['pid']} ready on " in text
    assert oct(path.parent.stat().st_mode & 0o777) == "0o700"


def test_the_log_level_setting_and_the_environment_variable_change_the_console(tmp_path):
    _, stderr = _run(tmp_path / "a", conf={"spark.steward.log.level": "info"})
    assert "INFO sparksteward.agents: driver agent" in stderr
    _, stderr = _run(tmp_path / "b", conf={"spark.steward.log.level": "ERROR"}, env={"SPARK_STEWARD_LOG_LEVEL": "INFO"})
    assert "INFO sparksteward.agents: driver agent" in stderr   # the environment overrides the setting
    _, stderr = _run(tmp_path / "c", env={"SPARK_STEWARD_LOG_LEVEL": "LOUD"})
    assert "SPARK_STEWARD_LOG_LEVEL='LOUD' is not a level" in stderr and " INFO " not in stderr


def test_an_executor_agent_has_a_log_file_of_its_own(tmp_path):
    health, stderr = _run(tmp_path, "executor", rendezvous_dir=str(tmp_path / "userFiles"))
    assert stderr == ""
    assert health["log_file"] == str(tmp_path / "state" / "logs" / "executor-agent-1.log")
    assert "executor agent" in Path(health["log_file"]).read_text()


def test_an_agent_whose_log_file_cannot_be_opened_runs_on_and_says_so(tmp_path):
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "logs").write_text("a file, not a directory")
    health, stderr = _run(tmp_path)
    assert health["log_file"] is None and health["state"] == "running"
    assert "cannot write the agent's log file" in stderr and "logging to stderr only" in stderr


@pytest.mark.parametrize("role,executor_id,name", [("driver", "driver", "driver-agent.log"),
                                                   ("executor", "7", "executor-agent-7.log"),
                                                   ("executor", "../x y", "executor-agent-.._x_y.log")])
def test_log_file_names(role, executor_id, name):
    assert log_file_name(role, executor_id) == name


def test_rebuilding_a_subtask_logs_at_info_only_when_it_rescales(tmp_path, caplog):
    m = 16
    storage = CheckpointStorage.open(str(tmp_path / "chk"), "levels")
    backends = [RocksDBStateBackend(tmp_path / f"w{i}", key_group_range(m, 2, i), m, "long") for i in range(2)]
    for k in range(200):
        b = backends[0] if key_group(k, m) in backends[0].key_groups else backends[1]
        b.value("v").update(k, 1)
    meta, _ = checkpoint_backends(storage, backends, 1, tmp_path / "snaps")
    for b in backends:
        b.close()
    caplog.set_level(logging.DEBUG, logger="sparksteward.checkpoint.task.subtask_restore")
    for parallelism, level in ((2, logging.DEBUG), (1, logging.INFO)):
        caplog.clear()
        b, _ = rebuild_subtask(storage, meta, parallelism, 0, tmp_path / f"r{parallelism}",
                               LocalFileCache(tmp_path / f"cache{parallelism}"))
        b.close()
        assert [r.levelno for r in caplog.records if "rebuilt subtask" in r.getMessage()] == [level], parallelism


def test_only_the_driver_agent_warns_about_an_unknown_key_and_strict_mode_refuses_it(tmp_path):
    typo = {"spark.steward.rpc.timeoutt": "5s"}
    _, stderr = _run(tmp_path / "d", conf=typo)
    assert stderr.count("unknown setting spark.steward.rpc.timeoutt ignored (did you mean spark.steward.rpc.timeout?)") == 1
    _, stderr = _run(tmp_path / "e", "executor", conf=typo, rendezvous_dir=str(tmp_path / "userFiles"))
    assert stderr == ""
    with AgentProcess("driver", {"spark.steward.state-dir": str(tmp_path / "state"), **typo,
                                 "spark.steward.config.strict": "true"}) as agent:
        assert agent.first["type"] == "fatal" and agent.first["code"] == "CONFIG_INVALID"
        assert "spark.steward.rpc.timeoutt" in agent.first["message"]
        assert "did you mean spark.steward.rpc.timeout?" in agent.first["message"]


def test_an_executor_agent_on_another_host_does_not_create_the_state_dir(tmp_path, monkeypatch):
    """Where the driver's state dir does not exist (another machine), an executor agent's log goes to
    YARN's LOG_DIRS or its working dir, in a steward-logs dir of its own (never chmod-ing either)."""
    from sparksteward.agents.logs import log_dir
    from sparksteward.config import StewardConfig

    cfg = StewardConfig.from_conf({"spark.steward.state-dir": str(tmp_path / "drivers-state")})
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LOG_DIRS", raising=False)
    assert log_dir(cfg, executor=True) == tmp_path / "steward-logs"
    monkeypatch.setenv("LOG_DIRS", f"{tmp_path / 'yarn1'},{tmp_path / 'yarn2'}")
    assert log_dir(cfg, executor=True) == tmp_path / "yarn1" / "steward-logs"
    assert log_dir(cfg, executor=False) == tmp_path / "drivers-state" / "logs"
    (tmp_path / "drivers-state").mkdir()   # the same host as the driver (local mode)
    assert log_dir(cfg, executor=True) == tmp_path / "drivers-state" / "logs"
    assert not (tmp_path / "yarn1").exists()


def _wait_for(path: Path, text: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in (path.read_text() if path.exists() else ""):
        assert time.monotonic() < deadline, f"{text!r} never reached {path}"
        time.sleep(0.05)


def _refused_connection(agent: AgentProcess) -> None:
    """One connection with a wrong secret: the agent warns about it (WARNING on its console)."""
    with pytest.raises(StewardError):
        agent.connect(secret="00" * 32)


@pytest.mark.parametrize("pin", [None, "spark.steward.log.level", "SPARK_STEWARD_LOG_LEVEL"])
def test_the_console_follows_spark_s_level_unless_the_configuration_pins_it(tmp_path, pin):
    """Issue 40: the agents followed neither ``sc.setLogLevel`` nor ``spark.log.level``. The shim now sends a
    ``log_level`` line when the JVM's level changes; a pinned level (the setting or the environment) wins."""
    conf = {"spark.steward.state-dir": str(tmp_path / "state"), "spark.log.level": "ERROR"}
    env = {"SPARK_STEWARD_LOG_LEVEL": ""}
    if pin == "spark.steward.log.level":
        conf[pin] = "WARN"
    elif pin:
        env[pin] = "WARN"
    err = tmp_path / "stderr"
    log_file = tmp_path / "state" / "logs" / "driver-agent.log"
    with err.open("wb") as out, AgentProcess("driver", conf, env=env, stderr=out) as agent:
        assert agent.ready, agent.first
        with agent.connect() as conn:
            assert conn.request("health")["log_level"] == ("ERROR" if pin is None else "WARN")   # spark.log.level at start
        _refused_connection(agent)
        agent.event("log_level", level="INFO")   # the JVM's at start (spark-submit's INFO): louder, not followed
        agent.event("log_level", level="DEBUG")   # sc.setLogLevel("DEBUG") ... and so on
        if pin is None:
            _wait_for(log_file, "console log level now DEBUG")
            assert "console log level now INFO" not in log_file.read_text()
        agent.event("log_level", level="INFO")
        if pin is None:
            _wait_for(log_file, "console log level now INFO")
        agent.event("log_level", level="FATAL")
        if pin is None:
            _wait_for(log_file, "console log level now FATAL")
        agent.event("log_level", level="WARN")
        if pin is None:
            _wait_for(log_file, "console log level now WARN")
        agent.event("log_level", level="LOUD")   # not a level: kept, and said once
        with agent.connect() as conn:
            assert conn.request("health")["log_level"] == "WARN"
        _refused_connection(agent)
        deadline = time.monotonic() + 20
        while log_file.read_text().count("authentication failed") < 2:   # the file has both (INFO)
            assert time.monotonic() < deadline, log_file.read_text()
            time.sleep(0.05)
        assert agent.stop() == 0
    refusals = err.read_text().count("authentication failed")
    assert refusals == (1 if pin is None else 2), err.read_text()   # the first hidden at ERROR, unless pinned
    assert ("Spark's log level 'LOUD' is not one we know" in err.read_text()) == (pin is None)


def test_a_quieter_level_at_start_is_followed(tmp_path):
    """An executor that Spark starts after a ``sc.setLogLevel("ERROR")`` starts at ERROR: the shim's first
    ``log_level`` line says so, and the agent (WARN by default) takes it."""
    log_file = tmp_path / "state" / "logs" / "driver-agent.log"
    with AgentProcess("driver", {"spark.steward.state-dir": str(tmp_path / "state")},
                      env={"SPARK_STEWARD_LOG_LEVEL": ""}) as agent:
        assert agent.ready, agent.first
        agent.event("log_level", level="ERROR")
        _wait_for(log_file, "console log level now ERROR")
        with agent.connect() as conn:
            assert conn.request("health")["log_level"] == "ERROR"
        assert agent.stop() == 0
