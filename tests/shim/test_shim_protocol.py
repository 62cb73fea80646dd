"""The Python side of the shim protocol against the golden files the Scala test also checks."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from sparksteward import shim_protocol
from sparksteward.errors import ProtocolError

GOLDEN = Path(__file__).resolve().parents[2] / "jvm-shim" / "src" / "test" / "resources" / "golden"


def test_every_message_type_has_a_golden_file():
    assert sorted(p.stem for p in GOLDEN.glob("*.json")) == sorted(shim_protocol.SCHEMAS)


@pytest.mark.parametrize("path", sorted(GOLDEN.glob("*.json")), ids=lambda p: p.stem)
def test_golden_decodes(path):
    raw = path.read_bytes()
    assert raw.endswith(b"\n") and raw.count(b"\n") == 1, "one message, one line"
    msg = shim_protocol.decode(raw)
    assert msg["type"] == path.stem


def test_python_encoder_writes_the_agent_goldens():
    ready = shim_protocol.encode_ready("driver", 4242, "127.0.0.1:40123", 35000)
    assert ready == (GOLDEN / "ready.json").read_bytes()
    fatal = shim_protocol.encode_fatal(
        "driver", "CONFIG_INVALID",
        "spark.steward.blob.retention.interval=-5s: must be a duration >= 0, such as 30min")
    assert fatal == (GOLDEN / "fatal.json").read_bytes()


def test_decoded_fields_keep_their_meaning():
    job_end = shim_protocol.decode((GOLDEN / "job_end.json").read_bytes())
    assert job_end["reason"] == 'Job aborted: \x01 "boom"'
    job_start = shim_protocol.decode((GOLDEN / "job_start.json").read_bytes())
    assert job_start["description"] == "count at <stdin>:1\nline2"
    assert job_start["job_tags"] == ["etl", "spark-session-u-thread-t-nightly"]


@pytest.mark.parametrize("line,match", [
    (b"not json", "not JSON"),
    (b"[1]", "not a JSON object"),
    (b'{"v":2,"type":"app_end","time":1,"exit_code":0,"checkpoint_dir":null}', "version 2"),
    (b'{"v":1,"type":"nope"}', "unknown protocol message type"),
    (b'{"v":1,"type":"app_end","time":1,"exit_code":0}', "lacks field 'checkpoint_dir'"),
    (b'{"v":1,"type":"job_end","time":1,"job_id":"3","result":"x","reason":null}', "wrong type"),
    (b'{"v":1,"type":"app_end","time":true,"exit_code":0,"checkpoint_dir":null}', "wrong type"),
    (b"x" * (shim_protocol.MAX_LINE + 1), "exceeds"),
])
def test_bad_lines_raise_protocol_errors(line, match):
    with pytest.raises(ProtocolError, match=match):
        shim_protocol.decode(line)


def test_unknown_extra_fields_are_tolerated():
    msg = shim_protocol.decode(orjson.dumps({"v": 1, "type": "app_end", "time": 1, "exit_code": None, "checkpoint_dir": None, "new": 1}))
    assert msg["new"] == 1
