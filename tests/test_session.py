"""What ``sparksteward.configure()`` changes, as the README's table lists it, and that a setting the user
made first always wins (the opt-out). No JVM starts: only the builder's options are read."""

from __future__ import annotations

import os
import sys

import pytest
import sparksteward
from sparksteward.shim_protocol import PLUGIN_CLASS

pytestmark = pytest.mark.compat

ADDED = {"spark.jars", "spark.plugins", "spark.hadoop.fs.steward.impl", "spark.python.daemon.module"}


def _builder():
    from pyspark.sql import SparkSession

    return SparkSession.Builder()


def test_on_a_bare_builder_it_sets_the_listed_settings_and_only_pyspark_python(monkeypatch):
    monkeypatch.delenv("PYSPARK_PYTHON", raising=False)
    env = dict(os.environ)
    options = sparksteward.configure(_builder(), jar="shim.jar")._options
    assert set(options) == ADDED
    assert options["spark.jars"] == "shim.jar" and options["spark.plugins"] == PLUGIN_CLASS
    assert options["spark.python.daemon.module"] == "sparksteward.daemon"
    assert os.environ.pop("PYSPARK_PYTHON") == sys.executable
    assert dict(os.environ) == env, "configure() changed another environment variable"


@pytest.mark.parametrize("python", ["conf", "env"])
def test_settings_made_first_are_kept(monkeypatch, python):
    monkeypatch.setenv("PYSPARK_PYTHON", "/opt/env-python")
    if python == "conf":
        monkeypatch.delenv("PYSPARK_PYTHON")
    mine = {"spark.jars": "a.jar,shim.jar", "spark.plugins": "x.Plugin", "spark.python.daemon.module": "pyspark.daemon",
            "spark.hadoop.fs.steward.impl": "x.FileSystem"}
    if python == "conf":
        mine["spark.pyspark.python"] = "/opt/conf-python"
    builder = _builder()
    for key, value in mine.items():
        builder = builder.config(key, value)
    options = sparksteward.configure(builder, jar="shim.jar")._options
    assert options == {**mine, "spark.plugins": f"x.Plugin,{PLUGIN_CLASS}"}
    assert os.environ.get("PYSPARK_PYTHON") == (None if python == "conf" else "/opt/env-python")
