"""What an Alloc's round trip is made of on this host: a bare Python socket ping-pong
between two processes, then a real receiver's (the one `kvtier bench pd` starts, in its
own process) protocol ping (a Release of no request), and an Alloc of a 16k-token
prompt's 64 chunks (then its Abort). Medians of 200; the decoder's side of each in
`kvtier.pd.receiver`.

    python3 -m kvtier_tools.bench.profiles.pd_rtt [--channel cuda_ipc] [--device cuda:1]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import time

from kvtier.engine import CacheEngine
from kvtier.keys import KVFormat
from kvtier.pd import protocol as proto
from kvtier.pd.link import DecoderLink
from kvtier.pd.sender import PdSender
from kvtier_tools.bench.offload import OffloadShape
from kvtier_tools.bench.pd import FMT_MODEL, _config, _paged, _Receiver, _tokens

ROUNDS = 200


def _echo(port_q) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port_q.put(listener.getsockname()[1])
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while data := conn.recv(64):
        conn.sendall(data)


def median_ms(fn) -> float:
    times = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[10:]) * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--channel", default="cuda_ipc")
    p.add_argument("--device", default="cuda:1")
    args = p.parse_args()
    q: mp.Queue = mp.Queue()
    echo = mp.Process(target=_echo, args=(q,), daemon=True)
    echo.start()
    sock = socket.create_connection(("127.0.0.1", q.get()))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    print(
        "bare socket ping-pong      "
        f"{median_ms(lambda: (sock.sendall(b'x' * 32), sock.recv(64))):.3f} ms"
    )
    sock.close()
    shape = OffloadShape(layers=2)
    kv, _ = _paged(shape, 256, "cpu", fill=False)
    with _Receiver(shape, args.channel, args.device, 16384) as receiver:
        config = _config(
            shape,
            "sender",
            args.channel,
            "cpu" if args.channel != "cuda_ipc" else "cuda:0",
            0,
            receiver.init,
            receiver.alloc,
        )
        engine = CacheEngine(config, kv, KVFormat(FMT_MODEL, "flash_attn", shape.dtype))
        sender = PdSender(engine, config, 0)
        link = DecoderLink(
            "127.0.0.1", receiver.init, receiver.alloc, sender._hello, sender.channel, 10
        )
        print(
            "protocol ping (Release)    "
            f"{median_ms(lambda: link.call(proto.Release('none'))):.3f} ms"
        )
        tokens = _tokens(16384, 5)
        spans = engine.spans(tokens, "x")
        print(f"hash 16k tokens (spans)    {median_ms(lambda: engine.spans(tokens)):.3f} ms")
        alloc_abort_ms = median_ms(
            lambda: (link.alloc("r", spans, 5, lambda: None), link.call(proto.Abort("r")))
        )
        print(f"Alloc of 64 chunks + Abort {alloc_abort_ms:.3f} ms")
        link.close()
        sender.close()
        engine.close()


if __name__ == "__main__":
    main()
