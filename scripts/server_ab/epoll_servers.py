"""Plain Python epoll servers speaking the raw benchmark's request/ack protocol
(kvtier.bench.server_clients.raw_server): `serve` on one thread, `serve_multi` on N
selector loops in N threads. No kvtier code: the limit of one thread vs a few."""

import selectors
import socket
import struct

import numpy as np

MiB = 1 << 20
_LEN = struct.Struct("<q")


def serve(port, ring=256 * MiB):
    """One thread: accepts and serves every connection."""
    sel = selectors.EpollSelector()
    lst = socket.create_server(("127.0.0.1", port))
    lst.setblocking(False)
    sel.register(lst, selectors.EVENT_READ, None)
    buf = memoryview(np.ones(ring, np.uint8))
    while True:
        for key, ev in sel.select():
            if key.data is None:
                c, _ = lst.accept()
                _register(sel, c)
            else:
                _handle(sel, key, ev, buf)


def _register(sel, c):
    c.setblocking(False)
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    head = memoryview(bytearray(8))
    sel.register(
        c,
        selectors.EVENT_READ,
        {"sock": c, "head": head, "target": head, "got": 0, "mode": "h", "i": 0, "out": None},
    )


def serve_multi(port, loops=2, ring=256 * MiB):
    """`loops` selector loops in threads; an acceptor hands connections round-robin."""
    import queue
    import threading

    buf = memoryview(np.ones(ring, np.uint8))
    sels = [selectors.EpollSelector() for _ in range(loops)]
    inbox = [queue.SimpleQueue() for _ in range(loops)]
    wake = [socket.socketpair() for _ in range(loops)]

    def run(i):
        sel = sels[i]
        r, _ = wake[i]
        r.setblocking(False)
        sel.register(r, selectors.EVENT_READ, "wake")
        while True:
            for key, ev in sel.select():
                if key.data == "wake":
                    r.recv(100)
                    while not inbox[i].empty():
                        _register(sel, inbox[i].get())
                    continue
                _handle(sel, key, ev, buf)

    for i in range(loops):
        threading.Thread(target=run, args=(i,), daemon=True).start()
    lst = socket.create_server(("127.0.0.1", port))
    n = 0
    while True:
        c, _ = lst.accept()
        inbox[n % loops].put(c)
        wake[n % loops][1].send(b"x")
        n += 1


def _handle(sel, key, ev, buf):
    s = key.data
    c = s["sock"]
    if ev & selectors.EVENT_WRITE:
        try:
            n = c.send(s["out"])
        except BlockingIOError:
            n = 0
        s["out"] = s["out"][n:]
        if not len(s["out"]):
            sel.modify(c, selectors.EVENT_READ, s)
        return
    while True:
        try:
            n = c.recv_into(s["target"][s["got"] :])
        except BlockingIOError:
            break
        if n == 0:
            sel.unregister(c)
            c.close()
            break
        s["got"] += n
        if s["got"] < len(s["target"]):
            continue
        s["got"] = 0
        if s["mode"] == "h":
            (n,) = _LEN.unpack(s["head"])
            off = (s["i"] % (len(buf) // abs(n))) * abs(n)
            s["i"] += 1
            if n >= 0:
                s["mode"], s["target"] = "p", buf[off : off + n]
                continue
            out = buf[off : off - n]
        else:
            out = memoryview(b"k")
        s["mode"], s["target"] = "h", s["head"]
        try:
            k = c.send(out)
        except BlockingIOError:
            k = 0
        if k < len(out):
            s["out"] = out[k:]
            sel.modify(c, selectors.EVENT_WRITE, s)
            break
