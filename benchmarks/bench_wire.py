"""Spark-free wire benchmark: a 256 MB ``blob.get`` streamed over loopback, and small requests per second.

Runs a real BlobServer behind a real AgentServer on 127.0.0.1 and a BlobClient in the same process.
``get_to_file`` never sends a boot id, so the server streams the body over the socket (the path a
cross-host executor takes) rather than handing over a file path.

    PYTHONPATH=python python benchmarks/bench_wire.py [--mb 256] [--requests 10000] [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from sparksteward.blob.client import BlobClient
from sparksteward.blob.server import BlobServer
from sparksteward.blob.store import VoidBlobStore
from sparksteward.wire import AgentServer, Connection, new_secret
from sparksteward.wire import connection as wire

MB = 1 << 20


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--body-mac", default="", help="force one body MAC (poly1305-large, poly1305 or hmac-sha256)")
    args = ap.parse_args()
    if args.body_mac:
        wire.BODY_MACS = (args.body_mac,)
    secret = new_secret()
    with tempfile.TemporaryDirectory() as d:
        server = BlobServer(Path(d) / "server", VoidBlobStore(), timer=False)
        sock = AgentServer("127.0.0.1", 0, secret, {"ping": lambda conn, req: {}})
        server.register_handlers(sock)
        conn = Connection.connect(sock.endpoint, secret)
        client = BlobClient(lambda: conn)
        fd, staged = client.staging_file()
        with os.fdopen(fd, "wb") as f:
            for _ in range(args.mb):
                f.write(os.urandom(MB))
        key = client.put_path(staged, "bench")
        rates = []
        for i in range(args.runs):
            dest = Path(d) / f"copy-{i}"
            t = time.perf_counter()
            client.get_to_file(key, dest, "bench")
            rates.append(args.mb / (time.perf_counter() - t))
            dest.unlink()
        print(f"loopback blob.get stream ({getattr(conn, 'body_mac', 'no MAC')}): {max(rates):,.0f} MB/s best of {args.runs} "
              f"({', '.join(f'{r:,.0f}' for r in rates)}; {args.mb} MB, verified, into a file)")
        t = time.perf_counter()
        for _ in range(args.requests):
            conn.request("ping")
        print(f"small requests: {args.requests / (time.perf_counter() - t):,.0f}/s "
              f"({args.requests:,} round trips on one connection)")
        conn.close()
        sock.close()
        server.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
