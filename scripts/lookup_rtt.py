"""What one scheduler -> worker lookup round trip costs on this host, the worker doing
nothing: a real `LookupServer` (its thread, as in vLLM's engine core on a GPU, where the
worker shares the scheduler's process) and a `LookupClient` over its ZMQ IPC socket.
Medians of 2,000 back to back ("hot") and of 30 after 20 ms idle each (as in serving,
where the worker's thread sleeps between asks).

    python3 scripts/lookup_rtt.py
"""

from __future__ import annotations

import os
import statistics
import time

from kvtier.integrations.vllm.lookup import Handlers, LookupClient, LookupServer, socket_path


def main() -> None:
    address = socket_path(f"rtt-{os.getpid()}", 0)
    server = LookupServer(
        address,
        Handlers(
            lookup=lambda tokens, rid, computed, beside: (0, 0, False),
            release=lambda rid: None,
            reset=lambda: None,
        ),
    )
    client = LookupClient([address], timeout_s=2)
    try:
        for i in range(200):
            client.release(f"w{i}")
        hot = []
        for i in range(2000):
            t0 = time.perf_counter()
            client.release(f"h{i}")
            hot.append(time.perf_counter() - t0)
        idle = []
        for i in range(30):
            time.sleep(0.02)
            t0 = time.perf_counter()
            client.release(f"i{i}")
            idle.append(time.perf_counter() - t0)
    finally:
        client.close()
        server.close()
    print(
        f"lookup round trip (a RELEASE): hot {statistics.median(hot) * 1e3:.3f} ms, "
        f"after 20 ms idle {statistics.median(idle) * 1e3:.3f} ms "
        f"(medians of {len(hot)} and {len(idle)})"
    )


if __name__ == "__main__":
    main()
