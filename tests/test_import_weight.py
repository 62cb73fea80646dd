"""What starting a process loads (issue 36): the driver agent hosts the checkpoint coordinator but opens
no RocksDB and decodes no Arrow, so importing its module loads neither rocksdict nor pyarrow; the
``state/`` and ``checkpoint/`` faces import their modules only when a name is first used."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _loaded(code: str, modules: tuple[str, ...]) -> dict[str, bool]:
    """Which of ``modules`` a fresh interpreter has loaded after running ``code``."""
    probe = f"{code}; import sys; print(' '.join(str(m in sys.modules) for m in {modules!r}))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": ":".join(sys.path), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    return dict(zip(modules, (w == "True" for w in out.stdout.split())))


def test_the_driver_agent_loads_neither_rocksdict_nor_pyarrow():
    assert _loaded("import sparksteward.agents.driver", ("rocksdict", "pyarrow")) == \
        {"rocksdict": False, "pyarrow": False}


@pytest.mark.parametrize(("face", "name", "module"), [
    ("sparksteward.state", "RocksDBStateBackend", "sparksteward.state.backend"),
    ("sparksteward.checkpoint", "CheckpointCoordinator", "sparksteward.checkpoint.coordination.coordinator"),
])
def test_a_package_face_imports_a_module_when_its_name_is_first_used(face, name, module):
    assert _loaded(f"import {face}", (module, "rocksdict", "pyarrow")) == \
        {module: False, "rocksdict": False, "pyarrow": False}
    assert _loaded(f"import {face}; {face}.{name}", (module,)) == {module: True}
