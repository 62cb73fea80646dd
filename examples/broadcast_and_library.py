"""Zero-copy broadcast of a numpy array and a library added at run time.

    python examples/broadcast_and_library.py
"""

from __future__ import annotations

import tempfile
import zipfile
from pathlib import Path

import numpy as np
import sparksteward
from pyspark.sql import SparkSession

spark = sparksteward.configure(SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")).getOrCreate()
st = sparksteward.Steward.get(spark)

weights = np.random.default_rng(0).random((2048, 2048))  # 32 MB
h = st.broadcast(weights)
sums = spark.sparkContext.parallelize(range(4), 4).map(lambda i: float(h.value[i].sum())).collect()
print("row sums from the workers:", [round(s, 3) for s in sums])

wheel = Path(tempfile.mkdtemp()) / "greet-1.0-py3-none-any.whl"
with zipfile.ZipFile(wheel, "w") as z:
    z.writestr("greet/__init__.py", "def hello(x):\n    return f'hello {x}'\n")
st.add_library(wheel)


def greet(x):
    import greet  # importable in every worker: fetched once per executor, by content

    return greet.hello(x)


print(spark.sparkContext.parallelize(["a", "b"], 2).map(greet).collect())
h.destroy()
spark.stop()
