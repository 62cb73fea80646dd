"""The pyspark versions we test, and ``configure()`` refusing the others: the list lives in
``sparksteward.config.TESTED_SPARK_VERSIONS`` and the Makefile's venvs and the README follow it. No JVM
starts: only the builder's options and ``pyspark.__version__`` are read."""

from __future__ import annotations

import re
import shutil
import subprocess

import pyspark
import pytest
import sparksteward
from sparksteward.config import TESTED_SPARK_VERSIONS
from sparksteward.errors import ConfigError
from sparksteward.session import VERSION_CHECK_KEY

from tests.helpers import REPO

pytestmark = pytest.mark.compat


def _builder():
    from pyspark.sql import SparkSession

    return SparkSession.Builder()


def test_the_installed_pyspark_is_a_tested_version():
    sparksteward.configure(_builder(), jar="shim.jar")
    assert re.match(r"\d+\.\d+", pyspark.__version__)[0] in TESTED_SPARK_VERSIONS


@pytest.mark.parametrize("version", [f"{v}.0" for v in TESTED_SPARK_VERSIONS] + [f"{TESTED_SPARK_VERSIONS[0]}.9"])
def test_every_patch_of_a_tested_minor_is_taken(monkeypatch, version):
    monkeypatch.setattr(pyspark, "__version__", version)
    assert sparksteward.configure(_builder(), jar="shim.jar")._options["spark.jars"] == "shim.jar"


@pytest.mark.parametrize("version", ["3.5.4", "4.4.1", "5.0.0", "4.10.0", "4.00.1", "unknown"])
def test_an_untested_version_is_refused_naming_it_the_tested_ones_and_the_override(monkeypatch, version):
    monkeypatch.setattr(pyspark, "__version__", version)
    with pytest.raises(ConfigError) as err:
        sparksteward.configure(_builder(), jar="shim.jar")
    message = str(err.value)
    assert f"pyspark {version} " in message
    assert ", ".join(TESTED_SPARK_VERSIONS) in message
    assert f"{VERSION_CHECK_KEY}=false" in message and f"pyspark=={TESTED_SPARK_VERSIONS[-1]}.*" in message


def test_the_check_turned_off_on_the_builder_runs_on_an_untested_version(monkeypatch):
    monkeypatch.setattr(pyspark, "__version__", "4.4.1")
    options = sparksteward.configure(_builder().config(VERSION_CHECK_KEY, "false"), jar="shim.jar")._options
    assert options["spark.jars"] == "shim.jar" and options[VERSION_CHECK_KEY] == "false"


def test_a_bad_value_of_the_setting_is_refused_naming_it(monkeypatch):
    with pytest.raises(ConfigError, match=rf"{re.escape(VERSION_CHECK_KEY)}='maybe' is not allowed: expected true or false"):
        sparksteward.configure(_builder().config(VERSION_CHECK_KEY, "maybe"), jar="shim.jar")


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_the_makefile_installs_the_newest_in_venv_and_each_other_in_its_own():
    def dry_run(target: str) -> str:
        return subprocess.run(["make", "-n", "-B", target], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout

    *older, newest = TESTED_SPARK_VERSIONS
    assert f"'pyspark=={newest}.*'" in dry_run(".venv/.installed")
    compat = dry_run("compat")
    for version in older:
        assert f".venv-{version}/bin/python -m pip install --quiet -e '.[test]' 'pyspark=={version}.*'" in compat
        assert f".venv-{version}/bin/python -m pytest -q -ra -m compat" in compat
    # .venv (the newest) is made first: the compat venvs take the dependencies that fit from it, never its pyspark
    assert not [ln for ln in compat.splitlines() if ln.startswith(".venv-") and f"pyspark=={newest}" in ln], compat
    assert "/steward-deps.pth" in compat


def test_the_readme_names_the_tested_versions():
    readme = (REPO / "README.md").read_text()
    line = next((ln for ln in readme.splitlines() if ln.startswith("Tested pyspark versions:")), "")
    assert line, "README.md has no line starting with 'Tested pyspark versions:'"
    assert re.findall(r"`(\d+\.\d+)`", line) == list(TESTED_SPARK_VERSIONS), line


def test_the_tested_set_has_every_minor_and_the_wheel_requires_exactly_it():
    """Issue 40: pip installed pyspark 4.2, which configure() refused. Every minor release from the
    oldest tested to the newest is tested, and the package requires that range and no more."""
    import configparser

    minors = [int(v.split(".")[1]) for v in TESTED_SPARK_VERSIONS]
    assert {v.split(".")[0] for v in TESTED_SPARK_VERSIONS} == {"4"}
    assert minors == list(range(minors[0], minors[-1] + 1)), TESTED_SPARK_VERSIONS
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    required = [ln.strip() for ln in cfg["options"]["install_requires"].splitlines() if ln.strip().startswith("pyspark")]
    assert required == [f"pyspark>={TESTED_SPARK_VERSIONS[0]},<4.{minors[-1] + 1}"], required
