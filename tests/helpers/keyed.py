"""Keyed-state data for Spark tests: random batches of (k, v), the count-and-sum function a state runs
over them, what pandas says the result is, and what the state holds. ``count_sum`` runs in Python
workers, which import it from here by reference."""

from __future__ import annotations

import random

import pandas as pd

SCHEMA = "k string, n long, s long"


def count_sum(key, rows, state):
    cur = state.get() or {"n": 0, "s": 0}
    cur = {"n": cur["n"] + len(rows), "s": cur["s"] + int(rows["v"].sum())}
    state.update(cur)
    return pd.DataFrame({"k": [key], "n": [cur["n"]], "s": [cur["s"]]})


def count_sum_row(key, rows, state):
    """:func:`count_sum` returning its output as a row (the per-key form's cheap return)."""
    cur = state.get() or {"n": 0, "s": 0}
    cur = {"n": cur["n"] + len(rows), "s": cur["s"] + int(rows["v"].sum())}
    state.update(cur)
    return key, cur["n"], cur["s"]


def count_sum_chunks(key, chunks, state):
    """:func:`count_sum` in the ``form="chunks"`` shape: the key's rows as an iterator of DataFrames."""
    n = s = 0
    for rows in chunks:
        n, s = n + len(rows), s + int(rows["v"].sum())
    cur = state.get() or {"n": 0, "s": 0}
    cur = {"n": cur["n"] + n, "s": cur["s"] + s}
    state.update(cur)
    return key, cur["n"], cur["s"]


def make_batches(seed: int, count: int = 3, rows: int = 300, keys: int = 25) -> list[pd.DataFrame]:
    rnd = random.Random(seed)
    return [pd.DataFrame({"k": [f"user-{rnd.randrange(keys)}" for _ in range(rows)],
                          "v": [rnd.randrange(100) for _ in range(rows)]}) for _ in range(count)]


def reference(batches: list[pd.DataFrame]) -> dict[str, tuple[int, int]]:
    allrows = pd.concat(batches)
    g = allrows.groupby("k")["v"].agg(["count", "sum"])
    return {k: (int(r["count"]), int(r["sum"])) for k, r in g.iterrows()}


def state_of(ks) -> dict[str, tuple[int, int]]:
    import orjson

    out = {}
    for r in ks.read().collect():
        v = orjson.loads(r.value)
        out[r.key] = (v["n"], v["s"])
    return out


def declared_count_events(key, rows, state):
    """Per key, with declared states: count (value), every v (list), how often each v (map)."""
    count = state.value("count")
    n = (count.get() or 0) + len(rows)
    count.update(n)
    state.list("events").extend(int(v) for v in rows["v"])
    seen = state.map("seen")
    for v in rows["v"]:
        seen.put(int(v), (seen.get(int(v)) or 0) + 1)
    return pd.DataFrame({"k": [key], "n": [n], "events": [len(state.list("events").get())],
                         "distinct": [len(seen.keys())]})


def read_values(checkpoint_dir: str, name: str, cluster_id: str, meta_json: dict,
                subtasks: list[int] | None = None) -> list[tuple[object, str]]:
    """Every (key, JSON value) of the default value state of a completed checkpoint."""
    from sparksteward.keyed_tasks import read_table

    table = read_table(checkpoint_dir, name, cluster_id, meta_json, None, subtasks=subtasks)
    return list(zip(table.column("key").to_pylist(), table.column("value").to_pylist()))
