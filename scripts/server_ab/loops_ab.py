"""Side by side, one run: raw thread-per-connection TCP, plain epoll servers on
one and two threads (epoll_servers.py), and `kvtier server` with 1 and 2 I/O
threads; GB/s and the ratio to raw, medians over repeats.

    .venv/bin/python scripts/server_ab/loops_ab.py 2 1,2,8 3     # MiB, connections, repeats

Used for results/DIARY.md ("What changed the multi-connection figures").
"""

import contextlib
import multiprocessing as mp
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import epoll_servers  # noqa: E402

from kvtier.bench import server as b  # noqa: E402
from kvtier.dev.localservers import free_port, kvtier_server, wait_for_port  # noqa: E402

if __name__ == "__main__":
    size, conns, reps = int(sys.argv[1]), [int(x) for x in sys.argv[2].split(",")], int(sys.argv[3])
    ctx = mp.get_context("spawn")
    targets, procs = {}, []
    for name, fn, args in [
        ("raw", b.raw_server, (256 * b.MiB,)),
        ("epoll-1", epoll_servers.serve, ()),
        ("epoll-2", epoll_servers.serve_multi, (2,)),
    ]:
        port = free_port()
        procs.append(ctx.Process(target=fn, args=(port, *args), daemon=True))
        procs[-1].start()
        wait_for_port(port)
        targets[name] = ("raw", str(port))
    clients = b._Clients(max(conns))
    with contextlib.ExitStack() as stack:
        for io in ("1", "2"):
            kv = stack.enter_context(kvtier_server(1.0, "--io-threads", io))
            targets[f"kvtier-io{io}"] = ("kvtier", f"127.0.0.1:{kv.ports[0]}")
        for c in conns:
            for op in ("put", "get"):
                res = {t: [] for t in targets}
                for _ in range(reps):
                    for t, (kind, addr) in targets.items():
                        res[t].append(
                            clients.run(
                                c, target=kind, address=addr, op=op, size=size * b.MiB, duration=1.0
                            )
                        )
                raw = statistics.median(res["raw"])
                print(
                    f"{op} {size} MiB x{c}: raw {raw:.2f} "
                    + " ".join(
                        f"{t} {statistics.median(v):.2f} ({statistics.median(v) / raw:.2f})"
                        for t, v in res.items()
                        if t != "raw"
                    ),
                    flush=True,
                )
    clients.close()
    for proc in procs:
        proc.terminate()
