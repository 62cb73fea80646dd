"""`steward blobs get`: what spark-submit's StewardFileSystem runs in client mode, before any agent exists.

It reads a URL printed by `steward blobs put` from a real HA store (a file:// path), verified against
its key, into a staged file; an unknown key, a corrupt HA copy or an application-scoped URL fail with
the URL and the fix, and leave no file behind. On a terminal, a progress line counts the bytes read.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from sparksteward.blob.cli import put
from sparksteward.blob.url import BlobUrl, app_scope
from sparksteward.cli import main

from tests.helpers.terminal import FakeTerminal


@pytest.fixture()
def jar(tmp_path: Path) -> Path:
    path = tmp_path / "udf.jar"
    path.write_bytes(b"PK\x03\x04 not really a jar" * 1000)
    return path


def _get(url: str, ha: Path, out: Path, capsys) -> tuple[int, str]:
    capsys.readouterr()  # what put said
    code = main(["blobs", "get", url, "--ha", str(ha), "--out", str(out)])
    cap = capsys.readouterr()
    return code, cap.out + cap.err


def test_get_writes_the_verified_blob_and_prints_its_path(tmp_path, jar, capsys):
    ha = tmp_path / "ha"
    url = put(jar, str(ha))
    out = tmp_path / "staged" / "udf.jar"
    code, said = _get(url, ha, out, capsys)
    assert code == 0, said
    assert said.strip() == str(out)
    assert out.read_bytes() == jar.read_bytes()
    assert [p.name for p in out.parent.iterdir()] == ["udf.jar"], "a staged temp file was left behind"


def test_an_unknown_key_names_the_url_and_the_fix(tmp_path, jar, capsys):
    ha = tmp_path / "ha"
    put(jar, str(ha))
    url = BlobUrl.parse(put(jar, str(ha)))
    other = str(url).replace(str(url.key), "p-" + "0" * 32)
    out = tmp_path / "staged" / "udf.jar"
    code, said = _get(other, ha, out, capsys)
    assert code == 2
    assert other in said and str(ha) in said and "steward blobs put" in said, said
    assert not out.exists()


def test_a_corrupt_ha_copy_is_refused_and_nothing_is_written(tmp_path, jar, capsys):
    ha = tmp_path / "ha"
    url = put(jar, str(ha))
    [stored] = [p for p in ha.rglob("p-*") if p.is_file()]
    stored.write_bytes(b"flipped" + stored.read_bytes()[7:])
    out = tmp_path / "staged" / "udf.jar"
    code, said = _get(url, ha, out, capsys)
    assert code == 2
    assert url in said and "does not match its key" in said and "steward blobs put" in said, said
    assert not out.exists() and not list(out.parent.glob("*")), "a corrupt copy must not stay staged"


def test_an_application_scoped_url_is_refused_with_the_fix(tmp_path, jar, capsys):
    ha = tmp_path / "ha"
    url = BlobUrl.parse(put(jar, str(ha)))
    app_url = str(BlobUrl(app_scope("some secret"), None, url.key, url.name))
    code, said = _get(app_url, ha, tmp_path / "out.jar", capsys)
    assert code == 2 and app_url in said and "steward blobs put" in said, said


def test_configure_hands_the_ha_path_to_the_file_system(tmp_path):
    import sparksteward
    from pyspark.sql import SparkSession

    ha = str(tmp_path / "ha")
    builder = SparkSession.Builder().config("spark.steward.blob.ha.storage-path", ha)
    options = sparksteward.configure(builder, jar=tmp_path / "shim.jar")._options
    assert options["spark.hadoop.fs.steward.ha.storage-path"] == ha
    # set by the user: kept; no HA store: nothing to hand over
    builder = SparkSession.Builder().config("spark.steward.blob.ha.storage-path", ha) \
        .config("spark.hadoop.fs.steward.ha.storage-path", "s3://other")
    options = sparksteward.configure(builder, jar="x.jar")._options
    assert options["spark.hadoop.fs.steward.ha.storage-path"] == "s3://other"
    builder = SparkSession.Builder().config("spark.steward.blob.ha.storage-path", "none")
    assert "spark.hadoop.fs.steward.ha.storage-path" not in sparksteward.configure(builder, jar="x.jar")._options


def test_get_shows_the_bytes_read_on_a_terminal(tmp_path, ha, capsys, monkeypatch):
    big = tmp_path / "big.jar"
    big.write_bytes(os.urandom(10 << 20))
    url = put(big, ha.url, "c1")
    capsys.readouterr()   # what put said
    args = ["--ha", ha.url, "--out"]
    assert main(["blobs", "get", url, *args, str(tmp_path / "piped.jar")]) == 0
    assert capsys.readouterr().err == ""   # no progress line off a terminal
    tty = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", tty)
    out = tmp_path / "staged" / "big.jar"
    assert main(["blobs", "get", url, *args, str(out)]) == 0
    assert out.read_bytes() == big.read_bytes() and capsys.readouterr().out.strip() == str(out)
    # 4 MB a chunk: the first is always shown, the last ends the line, the clock may skip the one between
    shown = tty.getvalue()
    assert shown.startswith("\rfetching big.jar: 4.0/10.0 MB\r") and shown.endswith("\rfetching big.jar: 10.0/10.0 MB\n")
    assert shown.count("\n") == 1
