"""`kvtier server`: the store server process (InfiniStore's role).

Client connections (connection.py) are served by a few uvloop event loops,
one per I/O thread (`--io-threads`, default: the CPUs, at most 4); the main
loop accepts, hands each new connection to the loop serving the fewest, and also
runs the management HTTP API (manage.py). A connection stays on its loop;
there is no thread per client. More than one loop because one thread moves
bytes on one core (results/README.md, "Figures behind constants in the
code"). The value pool is allocated once at
start (pool.py) and indexed with LRU eviction between watermarks
(index.py), one lock for all loops.

Access (auth.py): with `--auth-token` or `--tenants`, a connection proves
it holds a token (HMAC challenge-response in the handshake) before any
other op, and each token's keys live in its tenant's namespace. With
`--tls-cert/--tls-key` the KV port speaks TLS. Off loopback, a token is
required. Bounds, each a flag: connections (`--max-connections`), bytes one
connection holds leased or reserved (`--max-held-per-conn`), how long a
lease lives (`--lease-timeout`), how long a put's values may take to arrive
(`--put-deadline`), and how long a connection may stay silent
(`--idle-timeout`). Each hit is counted in /metrics and logged once per
client host.

RDMA: the flags InfiniStore takes (--dev-name, --link-type,
--hint-gid-index) are accepted. Without that device the server says so in
one line and serves TCP; the RDMA design is in docs/rdma.md.
"""

from __future__ import annotations

import asyncio
import functools
import signal
import socket
import threading
from collections.abc import Callable

from kvtier.errors import port_taken
from kvtier.logs import get_logger
from kvtier.server import protocol as p
from kvtier.server.connection import Connection
from kvtier.server.manage import start_management
from kvtier.server.state import ServerState

log = get_logger("kvtier.server")


class _LoopThread:
    """One more event loop, on its own thread, for client connections."""

    def __init__(self, name: str) -> None:
        import uvloop

        self.loop = uvloop.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class _Loops:
    """The event loops serving client connections, and how many each serves now
    (`live`, the state's list: STATS reports it)."""

    def __init__(self, loops: list[asyncio.AbstractEventLoop], live: list[int]) -> None:
        assert len(live) == len(loops)
        self.loops = loops
        self.live = live
        self._lock = threading.Lock()  # `live` is counted up here and down on the loops' threads

    def pick(self) -> int:
        """The loop with the fewest connections (the first of equals), counted as taken."""
        with self._lock:
            i = self.live.index(min(self.live))
            self.live[i] += 1
            return i

    def gone(self, i: int) -> None:
        with self._lock:
            self.live[i] -= 1

    def total(self) -> int:
        with self._lock:
            return sum(self.live)


async def _accept(listener: socket.socket, state: ServerState, loops: _Loops) -> None:
    """Accept connections; each goes to the loop serving the fewest. Past
    --max-connections, a new connection gets one error frame and is closed."""
    loop = asyncio.get_running_loop()
    while True:
        sock, addr = await loop.sock_accept(listener)
        if loops.total() >= state.opts.max_connections:
            _refuse(sock, addr, state)
            continue
        i = loops.pick()
        target = loops.loops[i]
        serve_on = target.connect_accepted_socket(_serving(state, loops, i), sock, ssl=state.tls)
        started = (
            loop.create_task(serve_on)
            if target is loop
            else asyncio.run_coroutine_threadsafe(serve_on, target)
        )
        started.add_done_callback(functools.partial(_not_started, i=i, sock=sock, loops=loops))


def _refuse(sock: socket.socket, addr, state: ServerState) -> None:
    limit = state.opts.max_connections
    state.index.count(refused_connections=1)
    state.note(
        str(addr[0]),
        "max-connections",
        f"connection refused: the server holds --max-connections {limit}",
    )
    if state.tls is None:  # over TLS the frame would need a handshake first: the close says enough
        message = f"too many connections (--max-connections {limit}); try again later".encode()
        try:
            sock.send(
                p.pack_header(p.Op.HELLO | p.REPLY, 0, len(message), flags=p.Status.ERROR) + message
            )
        except OSError:
            pass
    sock.close()


def _serving(state: ServerState, loops: _Loops, i: int) -> Callable[[], Connection]:
    """The protocol factory of a connection served on loop `i`."""
    return lambda: Connection(state, functools.partial(loops.gone, i))


def _not_started(started, i: int, sock: socket.socket, loops: _Loops) -> None:
    """A connection that failed before its protocol ran: uncount it."""
    if not started.cancelled() and started.exception() is None:
        return
    loops.gone(i)
    sock.close()
    log.info(
        "a new connection failed before it was served: %s",
        "cancelled" if started.cancelled() else started.exception(),
    )


def _listen(host: str, port: int) -> socket.socket:
    families = [a[0] for a in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)]
    # "localhost": where clients look first
    family = socket.AF_INET if socket.AF_INET in families else families[0]
    try:
        listener = socket.create_server((host, port), family=family, backlog=512)
    except OSError as e:
        raise port_taken(e, "kvtier server: --service-port", host, port) from None
    listener.setblocking(False)
    return listener


async def serve(state: ServerState, ready: asyncio.Event | None = None) -> None:
    """Run until SIGINT/SIGTERM (or cancellation)."""

    opts = state.opts
    if state.rdma_note:
        log.warning(state.rdma_note)
    loop = asyncio.get_running_loop()
    workers: list[_LoopThread] = []
    runner = listener = acceptor = None
    try:
        runner = await start_management(state, opts.host, opts.manage_port, opts.auth_token)
        workers = [_LoopThread(f"kvtier-io-{i}") for i in range(1, opts.io_threads)]
        # opens last: once it answers, the whole server is up
        listener = _listen(opts.host, opts.service_port)
        loops = _Loops([loop, *(w.loop for w in workers)], state.loop_connections)
        acceptor = loop.create_task(_accept(listener, state, loops))
        _log_started(state)
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        if ready is not None:
            ready.set()
        await stop.wait()
    finally:
        if acceptor is not None:  # it started
            log.info("kvtier server stopping")
            acceptor.cancel()
        if listener is not None:
            listener.close()
        for worker in workers:
            worker.stop()
        if runner is not None:
            await runner.cleanup()
        state.close()


def _log_started(state: ServerState) -> None:
    opts = state.opts
    log.info(
        "kvtier server on %s:%d (%s%s, %s, %d I/O threads), management http://%s:%d, "
        "pool %.2f GB in %d pages of %d KiB",
        opts.host,
        opts.service_port,
        "TLS" if state.tls else "TCP",
        ", same-host shared memory" if opts.shm else "",
        f"{len(state.tokens)} token(s)" if state.tokens else "no authentication",
        opts.io_threads,
        opts.host,
        opts.manage_port,
        state.pool.capacity / 1e9,
        state.pool.num_pages,
        opts.page_size >> 10,
    )
    log.info(
        "bounds: %d connections, %.0f MiB held per connection, "
        "leases %g s, put payloads %g s, idle %g s",
        opts.max_connections,
        state.max_held / 2**20,
        opts.lease_timeout,
        opts.put_deadline,
        opts.idle_timeout,
    )


def run(state: ServerState) -> None:
    import uvloop

    uvloop.run(serve(state))
