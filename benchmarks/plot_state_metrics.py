"""State bytes and checkpoint duration of a keyed state over a long-ish stream, plotted.

A streaming query reads ``BENCH_PLOT_BATCHES`` small JSON files (default 200, one per batch through
``maxFilesPerTrigger=1``) of ``BENCH_PLOT_ROWS`` rows (default 50); batch ``b`` touches keys
``(b * 20 + i) % BENCH_PLOT_KEYS`` (default 2,000), so the state grows for the first hundred batches and
then only updates. ``ks.process`` counts per key (P=2) and each batch's report (``ks.report``, the
figures of docs/state.md "Metrics") is kept. The plot (an SVG written by hand: no plotting library is
a dependency) shows the checkpointed and local state bytes and the bytes uploaded per batch, and the
checkpoint's duration (driver's begin to ``_metadata``) with its restore, sync, async and commit phases;
it goes to ``docs/img/state-metrics.svg`` (``BENCH_PLOT_OUT`` to change), the figures to a CSV beside it.

On local[2] (``BENCH_MASTER`` to change). Run under the Spark lock:
``flock /tmp/steward-spark.lock python benchmarks/plot_state_metrics.py`` (about 3 minutes).
"""

from __future__ import annotations

import csv
import html
import os
import sys
import time
from pathlib import Path
from typing import Any

import pandas as pd

os.environ.setdefault("BENCH_MASTER", "local[2]")
_HERE = str(Path(__file__).resolve().parent)
sys.path.insert(0, _HERE)
# the Python workers unpickle bench_state's warm-up function by reference
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_HERE, os.environ.get("PYTHONPATH")]))

import bench_state  # noqa: E402

BATCHES = int(os.environ.get("BENCH_PLOT_BATCHES", "200"))
ROWS = int(os.environ.get("BENCH_PLOT_ROWS", "50"))
KEYS = int(os.environ.get("BENCH_PLOT_KEYS", "2000"))
OUT = Path(os.environ.get("BENCH_PLOT_OUT", Path(__file__).resolve().parents[1] / "docs" / "img" / "state-metrics.svg"))


def count(key, rows, state):
    n = (state.get() or 0) + len(rows)
    state.update(n)
    return pd.DataFrame({"k": [key], "n": [n]})


def run(root: Path) -> int:
    from sparksteward import Steward

    indir = root / "in"
    indir.mkdir()
    for b in range(BATCHES):
        path = indir / f"part-{b:05d}.json"
        pd.DataFrame({"k": [f"user-{(b * 20 + i) % KEYS}" for i in range(ROWS)]}).to_json(
            path, orient="records", lines=True)
        os.utime(path, (1_700_000_000 + b, 1_700_000_000 + b))   # the file source takes them in this order
    spark = bench_state.start_session(root, "plot-metrics")
    try:
        ks = Steward.get(spark).keyed_state("plot", key="k", parallelism=2, max_parallelism=16,
                                            checkpoint_dir=str(root / "chk"))
        reports: list[dict[str, Any]] = []
        process = ks.process(count, "k string, n long", sink=lambda out, cid: None)

        def each(df: Any, batch_id: int) -> None:
            process(df, batch_id)
            report = ks.report(batch_id)
            if report is not None:
                reports.append(report)

        started = time.perf_counter()
        q = (spark.readStream.schema("k string").option("maxFilesPerTrigger", 1).json(str(indir))
             .writeStream.foreachBatch(each).option("checkpointLocation", str(root / "q"))
             .trigger(availableNow=True).start())
        q.awaitTermination()
        if q.exception() is not None:
            raise RuntimeError(f"the stream failed: {q.exception()}")
        took = time.perf_counter() - started
    finally:
        spark.stop()
    if len(reports) != BATCHES:
        print(f"expected {BATCHES} reports, got {len(reports)}", file=sys.stderr)
        return 1
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(svg(reports))
    table = OUT.with_suffix(".csv")
    with table.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=[k for k in reports[0] if k not in ("state", "query")],
                                extrasaction="ignore")
        writer.writeheader()
        writer.writerows(reports)
    last, durations = reports[-1], sorted(r["duration_ms"] for r in reports[1:] or reports)
    print(f"{BATCHES} batches in {took:.0f} s; last: {last['state_bytes']} B checkpointed, "
          f"{last['state_bytes_local']} B local, ~{last['entries_estimate']} entries; checkpoint duration p50 "
          f"{durations[len(durations) // 2]:.0f} ms, max {durations[-1]:.0f} ms; plot {OUT}, figures {table}")
    return 0


# --- the SVG ---------------------------------------------------------------------------------------
_W, _H, _PAD_L, _PAD_R, _PAD_T, _PAD_B = 760, 260, 70, 150, 30, 40
_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd"]


def _panel(reports: list[dict[str, Any]], y0: int, title: str, series: list[tuple[str, str]], unit: str,
           scale: float) -> list[str]:
    """One line chart at height offset ``y0``: each of ``series`` (figure, label) against the batch."""
    xs = [r.get("batch_id", i) for i, r in enumerate(reports)]
    top = max((r[f] for r in reports for f, _ in series), default=1) / scale or 1.0
    x_max = max(xs) or 1
    w, h = _W - _PAD_L - _PAD_R, _H - _PAD_T - _PAD_B

    def px(x: float) -> float:
        return _PAD_L + x / x_max * w

    def py(y: float) -> float:
        return y0 + _PAD_T + h - y / scale / top * h

    out = [f'<text x="{_PAD_L}" y="{y0 + 18}" font-size="14" font-weight="bold">{html.escape(title)}</text>',
           f'<rect x="{_PAD_L}" y="{y0 + _PAD_T}" width="{w}" height="{h}" fill="none" stroke="#999"/>']
    for i in range(5):   # the y grid and its labels
        v = top * i / 4
        y = py(v * scale)
        out.append(f'<line x1="{_PAD_L}" y1="{y:.1f}" x2="{_PAD_L + w}" y2="{y:.1f}" stroke="#eee"/>')
        label = f"{v:,.0f}" if v >= 10 or v == 0 else f"{v:.2g}"
        out.append(f'<text x="{_PAD_L - 6}" y="{y + 4:.1f}" font-size="11" text-anchor="end">{label}</text>')
    step = max(1, round(x_max / 5, -1 if x_max >= 50 else 0))
    for x in range(0, int(x_max) + 1, int(step)):   # the x labels
        out.append(f'<text x="{px(x):.1f}" y="{y0 + _PAD_T + h + 16}" font-size="11" '
                   f'text-anchor="middle">{x:.0f}</text>')
    out.append(f'<text x="{_PAD_L + w / 2}" y="{y0 + _H - 4}" font-size="11" text-anchor="middle">batch</text>')
    out.append(f'<text x="14" y="{y0 + _PAD_T + h / 2}" font-size="11" text-anchor="middle" '
               f'transform="rotate(-90 14 {y0 + _PAD_T + h / 2})">{html.escape(unit)}</text>')
    for n, (figure, label) in enumerate(series):
        points = " ".join(f"{px(x):.1f},{py(r[figure]):.1f}" for x, r in zip(xs, reports))
        color = _COLORS[n % len(_COLORS)]
        out.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.3" points="{points}"/>')
        ly = y0 + _PAD_T + 14 + 18 * n
        out.append(f'<line x1="{_PAD_L + w + 12}" y1="{ly - 4}" x2="{_PAD_L + w + 32}" y2="{ly - 4}" '
                   f'stroke="{color}" stroke-width="2"/>')
        out.append(f'<text x="{_PAD_L + w + 36}" y="{ly}" font-size="11">{html.escape(label)}</text>')
    return out


def svg(reports: list[dict[str, Any]]) -> str:
    """Two panels: state bytes, and checkpoint duration with its phases."""
    body = _panel(reports, 0, f"Keyed state bytes over {len(reports)} batches (P=2)",
                  [("state_bytes", "checkpointed"), ("state_bytes_local", "local snapshot"),
                   ("bytes_uploaded", "uploaded")], "KiB", 1024.0)
    body += _panel(reports[1:] or reports, _H, "Checkpoint duration per batch (batch 0, starting the workers, left out)",
                   [("duration_ms", "begin to _metadata"), ("async_ms", "async (slowest)"),
                    ("restore_ms", "restore (slowest)"), ("sync_ms", "sync (slowest)"), ("commit_ms", "commit")],
                   "ms", 1.0)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{2 * _H}" '
            f'font-family="sans-serif">\n<rect width="100%" height="100%" fill="white"/>\n'
            + "\n".join(body) + "\n</svg>\n")


def main() -> int:
    return bench_state.bench_main("plot-state-metrics-", run)


if __name__ == "__main__":
    sys.exit(main())
