"""The cross-host test's isolation probe says why it cannot isolate a worker, instead of failing
later or skipping silently (issue 7 item 1: "skip it with a reason, never silently")."""

from __future__ import annotations

import os

import pytest
from sparksteward.testing import standalone


@pytest.fixture(autouse=True)
def _fresh_probe():
    standalone.isolation_unavailable.cache_clear()
    yield
    standalone.isolation_unavailable.cache_clear()


def test_a_missing_unshare_is_named(monkeypatch, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("the probe stops at the uid check first when not root")
    monkeypatch.setenv("PATH", str(tmp_path))  # no unshare, no sh
    assert "unshare" in standalone.isolation_unavailable()


def test_a_refused_mount_reports_the_probes_stderr(monkeypatch, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("the probe stops at the uid check first when not root")
    fake = tmp_path / "unshare"
    fake.write_text("#!/bin/sh\necho 'unshare: unshare failed: Operation not permitted' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    reason = standalone.isolation_unavailable()
    assert "Operation not permitted" in reason and "exit code 1" in reason


def test_not_root_is_named(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "root" in standalone.isolation_unavailable()
