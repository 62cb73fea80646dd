"""The one registry of ops (wire/messages.py): the table in docs/architecture.md is the registry's, every
op a server serves is registered with its typed request and reply, and no production module sends or
serves a ``state.*``, ``blob.*`` or ``jobs.*`` op by a bare string."""

from __future__ import annotations

import re
from pathlib import Path

import sparksteward
from sparksteward.ops import BEGIN, END, all_ops, render_markdown

ROOT = Path(sparksteward.__file__).parent
REPO = ROOT.parent.parent


def test_the_op_table_in_the_docs_is_the_registry():
    text = (REPO / "docs" / "architecture.md").read_text()
    assert BEGIN in text and END in text
    table = text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n") + "\n"
    assert table == render_markdown(), "the op table differs from the code: run `make docs`"


def test_every_op_has_a_description_and_typed_classes():
    ops = all_ops()
    assert len(ops) >= 37
    for name, o in ops.items():
        assert o.doc, f"{o.request.__name__} ({name}) has no docstring: its first sentence is the op's description"
        assert name == o.request.OP and o.reply is not None
        assert re.fullmatch(r"(state|blob|jobs)\.[a-z_]+", name), name


def test_no_production_module_sends_or_serves_an_op_by_a_bare_string():
    bare = re.compile(r"""(?:\.request|\.call|add_handler|_driver|_request)\(\s*["'](?:state|blob|jobs)\.""")
    offenders = [f"{p.relative_to(ROOT)}:{n}" for p in ROOT.rglob("*.py") if "testing" not in p.parts
                 for n, line in enumerate(p.read_text().splitlines(), 1) if bare.search(line)]
    assert offenders == []
