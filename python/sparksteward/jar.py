"""Build and locate the JVM shim jar, offline, with the Scala compiler inside the installed pyspark.

The jar is compiled from the Scala sources shipped as package data (``sparksteward/shim-src``, a
folder whose name is not a Python identifier, so no one can import it and setuptools does not take
it for a package; in a checkout it is a symlink to ``jvm-shim/src/main/scala``) with the
``scala-compiler`` jar in ``pyspark/jars``, so it always matches that pyspark's Scala version. It is
cached under ``$SPARK_STEWARD_JAR_CACHE`` or ``~/.cache/spark-steward/jars``, named by the Scala binary
version, the package version and a hash of the sources and the Spark and compiler jars; a build takes
a file lock, so concurrent first uses build once. No Maven and no network are needed.
"""

from __future__ import annotations

import fcntl
import importlib.util
import logging
import os
import re
import shutil
import subprocess
import tempfile
import time
import zipfile
from pathlib import Path

import xxhash

from sparksteward.errors import ShimBuildError
from sparksteward.shim_protocol import PLUGIN_CLASS

__all__ = ["PLUGIN_CLASS", "pyspark_jars_dir", "run_shim_tests", "shim_jar"]

log = logging.getLogger("sparksteward.jar")

_SOURCES = Path(__file__).resolve().parent / "shim-src"
_REPO_SHIM = Path(__file__).resolve().parents[2] / "jvm-shim"


def pyspark_jars_dir() -> Path:
    """Return the jars folder of the Spark this Python uses, without importing pyspark.

    Returns
    -------
    Path
        ``$SPARK_HOME/jars`` if ``SPARK_HOME`` is set and has one, else ``<pyspark>/jars``.

    Raises
    ------
    ShimBuildError
        pyspark is not installed, or its ``jars`` folder is missing.
    """
    home = os.environ.get("SPARK_HOME")
    if home and (Path(home) / "jars").is_dir():
        return Path(home) / "jars"
    spec = importlib.util.find_spec("pyspark")
    if spec is None or not spec.origin:
        raise ShimBuildError("pyspark is not installed in this Python: `pip install pyspark` (4.x)")
    jars = Path(spec.origin).parent / "jars"
    if not jars.is_dir():
        raise ShimBuildError(f"{jars} does not exist: reinstall pyspark, or set SPARK_HOME to a Spark 4.x install")
    return jars


def _one(jars: Path, pattern: str) -> Path:
    found = sorted(jars.glob(pattern))
    if not found:
        raise ShimBuildError(f"no {pattern} in {jars}: spark-steward needs the jars of pyspark 4.x (Scala 2.13); "
                             "reinstall pyspark, or point SPARK_HOME at a complete Spark 4.x install")
    return found[-1]


def _java() -> str:
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").exists():
        return str(Path(home) / "bin" / "java")
    java = shutil.which("java")
    if not java:
        where = f"not in $JAVA_HOME/bin ({home}) and not on PATH" if home else "not on PATH and JAVA_HOME is not set"
        raise ShimBuildError(f"`java` is {where}: building the spark-steward shim (and running Spark) needs a "
                             "Java 17+ runtime; install one and set JAVA_HOME or put its bin/ on PATH")
    return java


def _cache_dir() -> Path:
    base = os.environ.get("SPARK_STEWARD_JAR_CACHE")
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "spark-steward" / "jars"


def _sources(root: Path) -> list[Path]:
    files = sorted(root.rglob("*.scala"))
    if not files:
        raise ShimBuildError(f"no Scala sources under {root}: reinstall spark-steward")
    return files


def _scalac(java: str, jars: Path, classpath: list[Path], out: Path, sources: list[Path]) -> None:
    compiler = [_one(jars, "scala-compiler-*.jar"), _one(jars, "scala-library-*.jar"), _one(jars, "scala-reflect-*.jar")]
    cmd = [java, "-cp", os.pathsep.join(map(str, compiler)), "scala.tools.nsc.Main", "-nowarn",
           "-classpath", os.pathsep.join(map(str, classpath)), "-d", str(out), *map(str, sources)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ShimBuildError(f"compiling the shim failed:\n{proc.stdout}{proc.stderr}")


def shim_jar(rebuild: bool = False) -> Path:
    """Return the shim jar's path, compiling it first if no matching jar is cached.

    Thread- and process-safe: a build holds an exclusive lock on ``.build.lock`` in the cache folder
    and re-checks the cache under it, so concurrent first uses compile once. The jar is staged in the
    cache folder and renamed into place.

    Parameters
    ----------
    rebuild : bool
        Compile even if a cached jar exists.

    Returns
    -------
    Path
        ``<cache>/spark-steward-shim_<scala>-<version>-<hash12>.jar``.

    Raises
    ------
    ShimBuildError
        pyspark's jars, the sources or Java are missing, or scalac failed (its output is in the message).
    """
    from sparksteward import __version__

    jars = pyspark_jars_dir()
    core = _one(jars, "spark-core_*.jar")
    compiler = _one(jars, "scala-compiler-*.jar")
    scala = re.search(r"spark-core_([0-9.]+)-", core.name)
    if scala is None:
        raise ShimBuildError(f"cannot read the Scala version from {core}: expected spark-core_<scala>-<version>.jar")
    sources = _sources(_SOURCES)
    digest = xxhash.xxh3_64()
    for src in sources:
        digest.update(str(src.relative_to(_SOURCES)).encode() + b"\0" + src.read_bytes() + b"\0")
    digest.update(f"{core.name}\0{compiler.name}".encode())
    cache = _cache_dir()
    target = cache / f"spark-steward-shim_{scala.group(1)}-{__version__}-{digest.hexdigest()[:12]}.jar"
    if target.exists() and not rebuild:
        return target
    cache.mkdir(parents=True, exist_ok=True)
    java = _java()
    with open(cache / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists() and not rebuild:
            return target
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="steward-shim-", dir=cache) as tmp:
            classes = Path(tmp) / "classes"
            classes.mkdir()
            _scalac(java, jars, sorted(jars.glob("*.jar")), classes, sources)
            staged = Path(tmp) / target.name
            with zipfile.ZipFile(staged, "w", zipfile.ZIP_DEFLATED) as zf:
                zf.writestr("META-INF/MANIFEST.MF", f"Manifest-Version: 1.0\nImplementation-Title: spark-steward-shim\n"
                                                    f"Implementation-Version: {__version__}\n\n")
                for f in sorted(classes.rglob("*")):
                    if f.is_file():
                        zf.write(f, f.relative_to(classes).as_posix())
            os.replace(staged, target)
        log.info("built %s in %.1f s", target, time.monotonic() - started)
    return target


def run_shim_tests() -> subprocess.CompletedProcess[str]:
    """Compile and run the Scala golden-protocol test ``sparksteward.shim.ProtocolGoldenTest``.

    Returns
    -------
    subprocess.CompletedProcess
        With captured text ``stdout`` (one line per check, then ``N passed, M failed``) and
        ``stderr``; ``returncode`` is 0 when every check passed.

    Raises
    ------
    ShimBuildError
        Not run from a source checkout, or the shim or the test did not compile.
    """
    tests = _REPO_SHIM / "src" / "test"
    if not tests.is_dir():
        raise ShimBuildError(f"{tests} not found: the Scala tests run from a source checkout only")
    jars = pyspark_jars_dir()
    jar = shim_jar()
    java = _java()
    with tempfile.TemporaryDirectory(prefix="steward-shim-test-") as tmp:
        classpath = [jar, *sorted(jars.glob("*.jar"))]
        _scalac(java, jars, classpath, Path(tmp), _sources(tests / "scala"))
        run_cp = os.pathsep.join(map(str, [Path(tmp), *classpath]))
        return subprocess.run([java, "-cp", run_cp, "sparksteward.shim.ProtocolGoldenTest",
                               str(tests / "resources" / "golden")], capture_output=True, text=True)
