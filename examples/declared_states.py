"""Declared keyed states on local[2]: a typed value, list and map state per user, with a TTL.

    make example-declared        (or: python examples/declared_states.py)

Three batches of page views go through ``sessions.apply`` (per key) and ``commit``. Each user keeps a
view count (value state), the pages seen (list state) and a count per page (map state), all expiring
30 seconds after their last write. Between the second and third batch the example waits 31 seconds: the
users who were idle come back with empty state, and the sweep removes their entries. Then every
variable is read back as a DataFrame, and the state is opened again with its count widened from int
to bigint: an accepted evolution. A narrowing is refused with the variable named.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import pandas as pd
import sparksteward
from pyspark.sql import SparkSession
from sparksteward import list_state, map_state, value_state
from sparksteward.errors import StateSchemaError

#: seconds of processing time; batch 1 must come within it of batch 0, whose first Python workers and agents
#: take several seconds to start on a busy laptop (8 s was too short beside two other Spark applications, and
#: 20 s beside three on a slow day: batch 0's time is taken when it begins, before its workers start)
TTL = 30.0


def visit(user, rows: pd.DataFrame, state) -> pd.DataFrame:
    views = state.value("views")                       # a declared value state: get() / update(v) / clear()
    n = (views.get() or 0) + len(rows)
    views.update(n)
    state.list("pages").extend(rows["page"])          # a list state: append(v) / extend(vs) / get() / clear()
    per_page = state.map("per_page")                   # a map state: get / put / remove / items / keys
    for page in rows["page"]:
        per_page.put(page, (per_page.get(page) or 0) + 1)
    return pd.DataFrame({"user": [user], "views": [n], "pages": [len(state.list("pages").get())],
                         "distinct": [len(per_page.keys())]})


def batch(spark, sessions, checkpoint_id: int, views: list[tuple[str, str]]) -> list[tuple]:
    df = spark.createDataFrame(pd.DataFrame(views, columns=["user", "page"]))
    out = sessions.apply(df, visit, "user string, views int, pages long, distinct long", checkpoint_id=checkpoint_id)
    rows = sorted(tuple(r) for r in out.collect())
    sessions.commit(checkpoint_id)
    return rows


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="steward-declared-"))
    spark = sparksteward.configure(SparkSession.builder.master("local[2]").appName("declared-states")).getOrCreate()
    try:
        st = sparksteward.Steward.get(spark)
        declared = [value_state("views", "int", ttl=TTL), list_state("pages", "string", ttl=TTL),
                    map_state("per_page", "string", "bigint", ttl=TTL)]
        sessions = st.keyed_state("sessions", key="user", parallelism=2, checkpoint_dir=str(work / "chk"),
                                  states=declared)
        print("batch 0:", batch(spark, sessions, 0, [("ann", "/a"), ("ann", "/b"), ("bob", "/a")]))
        print("batch 1:", batch(spark, sessions, 1, [("ann", "/a"), ("cid", "/c")]))
        time.sleep(TTL + 1)                            # everyone's state expires; ann comes back
        print("batch 2:", batch(spark, sessions, 2, [("ann", "/d")]))
        print("expired entries removed:", sessions.info()["checkpoints"][-1]["ttl_expired_removed"])
        print("views:", sorted(tuple(r) for r in sessions.read("views").collect()))
        print("pages:", sorted(tuple(r) for r in sessions.read("pages").collect()))
        print("per_page:", sorted(tuple(r) for r in sessions.read("per_page").collect()))

        try:
            st.keyed_state("sessions", key="user", parallelism=2, checkpoint_dir=str(work / "chk"),
                           states=[value_state("views", "smallint", ttl=TTL)])
        except StateSchemaError as exc:
            print("refused:", str(exc).split(". ")[0])
        widened = st.keyed_state("sessions", key="user", parallelism=2, checkpoint_dir=str(work / "chk"),
                                 states=[value_state("views", "bigint", ttl=TTL)])
        print("views now:", widened.states["variables"]["views"]["types"])
        print("declared states example finished")
    finally:
        spark.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
