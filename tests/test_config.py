"""The typed option registry: parsing, clear errors, generated docs kept in sync."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
from sparksteward.config import (
    OPTIONS,
    StewardConfig,
    log_level,
    parse_bytes,
    parse_duration,
    render_defaults_conf,
    render_markdown,
)
from sparksteward.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def test_zero_configuration_gives_embedded_local_defaults(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    cfg = StewardConfig.from_conf({})
    assert cfg.cluster_id == "default" and cfg.blob_retention_interval == 1800
    assert cfg.effective_jrs_path == str(tmp_path / "spark-steward" / "job-results")
    assert cfg.effective_ha_path == str(tmp_path / "spark-steward" / "ha")
    assert not cfg.jrs_delete_on_commit


@pytest.mark.parametrize("text,seconds", [("30min", 1800), ("5s", 5), ("250ms", 0.25), ("1h", 3600),
                                          ("30d", 2592000), ("7", 7)])
def test_durations_use_spark_syntax(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text,n", [("64k", 65536), ("256m", 256 << 20), ("10g", 10 << 30), ("12", 12)])
def test_sizes_use_spark_syntax(text, n):
    assert parse_bytes(text) == n


@pytest.mark.parametrize("key,value,allowed", [
    ("spark.steward.blob.retention.interval", "-5s", "duration >= 0"),
    ("spark.steward.blob.retention.interval", "soon", "duration >= 0"),
    ("spark.steward.blob.cache.max-size", "0", "size > 0"),
    ("spark.steward.jrs.delete-on-commit", "maybe", "true or false"),
    ("spark.steward.cluster-id", "a/b", "letters, digits"),
    ("spark.steward.driver.port", "-1", "0 to 65535"),
])
def test_bad_values_name_key_value_and_what_is_allowed(key, value, allowed):
    with pytest.raises(ConfigError) as info:
        StewardConfig.from_conf({key: value})
    assert key in str(info.value) and repr(value) in str(info.value) and allowed in str(info.value)


def test_unknown_keys_are_warned_about_with_a_suggestion(caplog):
    StewardConfig.from_conf({"spark.steward.blob.retention.intervall": "5s"})
    assert "did you mean spark.steward.blob.retention.interval" in caplog.text


def test_config_is_frozen():
    cfg = StewardConfig.from_conf({})
    with pytest.raises(AttributeError):   # dataclasses.FrozenInstanceError
        cfg.cluster_id = "x"  # type: ignore[misc]


# the annotation each option kind parses into
_KIND_TYPES = {"str": "str", "id": "str", "url": "str", "bool": "bool", "int": "int", "float": "float",
               "duration": "float", "bytes": "int", "json": "dict[str, dict[str, Any]]"}


def test_config_fields_are_the_registry_options_with_their_parsed_defaults():
    fields = [f for f in dataclasses.fields(StewardConfig) if f.name != "extra"]
    assert [f.name for f in fields] == [o.attr for o in OPTIONS]
    for f, o in zip(fields, OPTIONS):
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        assert default == o.parse(o.default) and type(default) is type(o.parse(o.default)), o.key
        assert f.type == _KIND_TYPES[o.kind], o.key
    assert StewardConfig() == StewardConfig.from_conf({})


def test_every_option_is_documented_and_generated_files_are_in_sync():
    assert all(o.key.startswith("spark.steward.") and o.description for o in OPTIONS)
    assert (ROOT / "docs" / "configuration.md").read_text() == render_markdown(), "run `make docs`"
    assert (ROOT / "conf" / "spark-defaults.conf.example").read_text() == render_defaults_conf(), "run `make docs`"


def test_an_unknown_key_is_warned_about_once_per_process(caplog):
    conf = {"spark.steward.rpc.timeoutt": "5s"}
    for _ in range(3):  # the client, keyed states and the agents parse the same conf again and again
        StewardConfig.from_conf(conf)
    assert caplog.text.count("unknown setting spark.steward.rpc.timeoutt") == 1
    assert "did you mean spark.steward.rpc.timeout?" in caplog.text


def test_strict_mode_refuses_an_unknown_key_naming_it_and_the_closest_known_key():
    with pytest.raises(ConfigError) as info:
        StewardConfig.from_conf({"spark.steward.config.strict": "true", "spark.steward.jrs.retension": "7d"})
    first = str(info.value).splitlines()[0]
    assert "spark.steward.jrs.retension" in first and "did you mean spark.steward.jrs.retention?" in first
    assert "spark.steward.config.strict=true" in first
    with pytest.raises(ConfigError, match="no known key is close"):
        StewardConfig.from_conf({"spark.steward.config.strict": "true", "spark.steward.zzzzzz": "1"})
    assert StewardConfig.from_conf({"spark.steward.config.strict": "true"}).config_strict


@pytest.mark.parametrize("value,level", [("WARN", logging.WARNING), ("debug", logging.DEBUG), ("info", logging.INFO),
                                         ("OFF", logging.CRITICAL + 10), ("TRACE", logging.DEBUG)])
def test_log_level_takes_spark_level_names(value, level):
    assert log_level(StewardConfig.from_conf({"spark.steward.log.level": value}).log_level) == level


def test_a_bad_log_level_names_the_allowed_ones():
    with pytest.raises(ConfigError, match=r"spark.steward.log.level='LOUD'.*TRACE, DEBUG, INFO, WARN, ERROR or OFF"):
        StewardConfig.from_conf({"spark.steward.log.level": "LOUD"})


def test_processes_that_parse_a_conf_the_driver_agent_checked_keep_quiet(caplog):
    StewardConfig.from_conf({"spark.steward.blob.max-sise": "1g"}, warn=False)
    assert "max-sise" not in caplog.text
    with pytest.raises(ConfigError, match="did you mean spark.steward.blob.max-size"):  # strict still refuses
        StewardConfig.from_conf({"spark.steward.blob.max-sise": "1g", "spark.steward.config.strict": "on"}, warn=False)
