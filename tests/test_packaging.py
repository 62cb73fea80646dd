"""The sdist and the wheel, built as ``make dist`` builds them and installed as a user installs them.

``python -m build`` makes the sdist from the checkout and the wheel from the unpacked sdist, each in an
isolated build environment (setuptools comes from the package index or pip's cache; pyspark is never
downloaded). The wheel goes with ``--no-index --no-deps`` into a new venv that sees this Python's
site-packages folders through ``.pth`` lines, for the dependencies only: such a line adds a folder to
``sys.path`` without running the ``.pth`` files in it, so the editable install of the checkout stays
off and ``sparksteward`` comes from the wheel.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from sparksteward.jar import shim_jar

REPO = Path(__file__).resolve().parents[1]
SHIM_SOURCES = REPO / "jvm-shim" / "src" / "main" / "scala"

_CHECK = """
import json, importlib.metadata, sparksteward
from sparksteward import jar
print(json.dumps({"module": sparksteward.__file__, "version": importlib.metadata.version("spark-steward"),
                  "sources": sorted(p.relative_to(jar._SOURCES).as_posix() for p in jar._sources(jar._SOURCES)),
                  "jar": str(jar.shim_jar())}))
"""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONNOUSERSITE"] = "1"
    return env


def _run(cmd: list[str], cwd: Path) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> tuple[Path, Path, str]:
    pytest.importorskip("build", reason="`python -m build` is in the test extras: pip install -e '.[test]'")
    out = tmp_path_factory.mktemp("dist")
    log = _run([sys.executable, "-m", "build", "--outdir", str(out), str(REPO)], cwd=out)
    (sdist,) = out.glob("spark_steward-*.tar.gz")
    (wheel,) = out.glob("spark_steward-*.whl")
    return sdist, wheel, log


def test_the_build_prints_no_setuptools_warning(dist):
    *_, log = dist
    # `build` prints a backend warning as "WARNING ...", pip as "...Warning: ..."
    assert "would be ignored" not in log and not re.search(r"^WARNING |\b\w+Warning\b", log, re.M), log


def test_no_data_folder_of_the_wheel_looks_like_a_package(dist):
    _, wheel, _ = dist
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    scala = sorted(n for n in names if n.endswith(".scala"))
    assert scala == sorted(f"sparksteward/shim-src/{p.relative_to(SHIM_SOURCES).as_posix()}"
                           for p in SHIM_SOURCES.rglob("*.scala"))
    folders = {str(Path(n).parent) for n in names if n.startswith("sparksteward/")}
    importable = {f for f in folders if all(part.isidentifier() for part in Path(f).parts)}
    assert {f for f in importable if f"{f}/__init__.py" not in names} == set(), \
        "a folder of the wheel is importable but not a package: setuptools warns about it"


def test_the_sdist_has_the_package_and_the_scala_sources_but_no_tests(dist):
    sdist, _, _ = dist
    with tarfile.open(sdist) as tf:
        names = [n.split("/", 1)[1] for n in tf.getnames() if "/" in n]
    assert "setup.cfg" in names and "python/sparksteward/__init__.py" in names
    assert "python/sparksteward/shim-src/sparksteward/shim/StewardPlugin.scala" in names
    assert not [n for n in names if n.startswith("tests/")]


def test_the_installed_wheel_finds_its_shim_sources_and_jar(dist, tmp_path):
    _, wheel, _ = dist
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path)
    python = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-index", "--no-deps",
          str(wheel)], cwd=tmp_path)
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     cwd=tmp_path).strip())
    dependencies = [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages")]
    (site / "zz_dependencies.pth").write_text("\n".join(dependencies) + "\n")
    jar = shim_jar()  # built (or found) from the checkout
    mtime = jar.stat().st_mtime_ns

    found = json.loads(_run([str(python), "-c", _CHECK], cwd=tmp_path).strip().splitlines()[-1])

    assert Path(found["module"]).is_relative_to(site), f"sparksteward came from {found['module']}, not the wheel"
    assert found["version"] in wheel.name
    assert found["sources"] == sorted(p.relative_to(SHIM_SOURCES).as_posix() for p in SHIM_SOURCES.rglob("*.scala"))
    assert Path(found["jar"]) == jar and jar.stat().st_mtime_ns == mtime, \
        "the wheel's sources must hash to the checkout's jar, without a rebuild"
    usage = _run([str(venv / "bin" / "steward"), "--help"], cwd=tmp_path)
    assert "checkpoints" in usage
