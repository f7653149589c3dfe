"""Device staging for the GPU transfer: the chunks of one transfer side by side in
device memory, the copies between it and the host chunks (one per run of
neighbouring blocks), the address tables the kernels read, and digest tables."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvtier.codec import DIGEST_A, DIGEST_B
from kvtier.stalls import synchronized
from kvtier.transfer import cudart
from kvtier.transfer.kernels import DIGEST_BLOCK, digest_kernel, host_runs_kernel

# A run of chunks in a strided copy: (host address, device address, host pitch, device pitch,
# bytes per row, rows).
Run = tuple[int, int, int, int, int, int]


class Staging:
    """Device memory for the chunks of one transfer, and the copies between it and them.

    Chunks are split into `groups` by token order; within a group they are
    laid out in the order of their host addresses, and `runs` of them
    (equal sizes, equal distances apart in one host allocation: adjacent
    pool blocks) cross PCIe in one strided copy, whole or one layer at a time.
    """

    def __init__(
        self,
        chunks: Sequence[torch.Tensor],
        device: torch.device,
        layer_major: bool,
        groups: int = 1,
    ) -> None:
        # Addresses are Python ints until a table is asked for: a load or store of a chat turn
        # builds one of these on vLLM's engine thread, where each small torch op on the host is
        # microseconds (results/gpu-h200-vllm-2026-11-29/README.md, 04:51 UTC: host time a chat
        # request).
        self.chunks = list(chunks)
        n = len(self.chunks)
        self.chunk_bytes = [c.numel() * c.element_size() for c in chunks]
        self.layer_bytes = [b // c.shape[0] for b, c in zip(self.chunk_bytes, chunks)]
        self.flat = torch.empty(sum(self.chunk_bytes), dtype=torch.uint8, device=device)
        size = (-(-n // groups)) if groups > 1 else n
        self.groups = [range(a, min(a + size, n)) for a in range(0, n, size)]
        host = [c.data_ptr() for c in self.chunks]
        by_group = [sorted(g, key=host.__getitem__) for g in self.groups]
        self.runs = [runs(self.chunks, order, self.chunk_bytes, host) for order in by_group]
        # Address of each chunk's slot, in staging order (by group, then host address).
        unit = self.layer_bytes if layer_major else self.chunk_bytes
        self._start = [0] * n
        at = self.flat.data_ptr()
        for order in by_group:
            for c in order:
                self._start[c] = at
                at += unit[c]
        # Layer-major: layer l of every chunk follows layer l-1 of every chunk.
        # Chunk-major: layer l of a chunk follows its layer l-1.
        self._layer_step = [at - self.flat.data_ptr()] * n if layer_major else self.layer_bytes

    def _at(self, layer: int, chunk: int) -> int:
        return self._start[chunk] + layer * self._layer_step[chunk]

    def ptrs(self, layers: range) -> torch.Tensor:
        """[len(layers), chunks] device addresses of each layer of each chunk."""
        if len(layers) == 1:
            return torch.tensor(
                [[s + layers.start * step for s, step in zip(self._start, self._layer_step)]],
                dtype=torch.int64,
            )
        return (
            torch.tensor(self._start, dtype=torch.int64)[None, :]
            + torch.arange(layers.start, layers.stop)[:, None]
            * torch.tensor(self._layer_step)[None, :]
        )

    def digest_tables(self, by_layer: bool) -> torch.Tensor:
        """(address, bytes, first word) of each chunk in staging: [1, chunks, 3] whole,
        or [L, chunks, 3] layer by layer (layer-major staging), for DigestTables."""
        if not by_layer:
            return torch.tensor(
                [[(s, b, 0) for s, b in zip(self._start, self.chunk_bytes)]], dtype=torch.int64
            )
        starts = torch.tensor(self._start, dtype=torch.int64)
        return layer_tables(
            starts,
            torch.tensor(self._layer_step, dtype=torch.int64),
            self.layer_bytes,
            self.chunks[0].shape[0],
        )

    def run_table(self, layer: int | None = None, group: int = 0) -> list[Run]:
        """The runs of a group (chunk-major, whole chunks) or of one layer (layer-major):
        (host address, device address, host pitch, device pitch, bytes per row, rows). A
        run's chunks are neighbours in staging: its device-side rows are a row apart."""
        out: list[Run] = []
        for first, count, pitch in self.runs[group]:
            width = self.chunk_bytes[first] if layer is None else self.layer_bytes[first]
            host = self.chunks[first].data_ptr() + (0 if layer is None else layer * width)
            out.append(
                (host, self._at(0 if layer is None else layer, first), pitch, width, width, count)
            )
        return out

    def copy(
        self, to_host: bool, stream: torch.cuda.Stream, layer: int | None = None, group: int = 0
    ) -> None:
        """The runs of `run_table(layer, group)` between staging and host, by the copy engine."""
        for host, dev, host_pitch, dev_pitch, width, rows in self.run_table(layer, group):
            if to_host:
                cudart.memcpy2d(host, host_pitch, dev, dev_pitch, width, rows, stream)
            else:
                cudart.memcpy2d(dev, dev_pitch, host, host_pitch, width, rows, stream)


class Upload:
    """Host chunks on their way into device staging: their copies queued on the copy
    stream, before the slots they go to are known (a hit, at the scheduler's lookup). A
    scatter given it queues only its kernels; the staging lives as long as this does."""

    def __init__(
        self,
        staging: Staging,
        ptrs: torch.Tensor,
        sums: DigestTables | None,
        landed: list[torch.cuda.Event],
        layer_major: bool,
        keep: object = None,
    ) -> None:
        self.staging = staging
        self.ptrs = ptrs
        self.sums = sums
        self.landed = landed
        self.layer_major = layer_major
        self._keep = keep  # what the copies read besides the chunks (a kernel's pinned run table)

    def chunks(self) -> list[torch.Tensor]:
        return self.staging.chunks

    def wait(self) -> None:
        """Return once the host chunks are no longer read (they may be released)."""
        if self.landed:  # one copy stream: the last copy queued ends last
            synchronized("an upload", self.landed[-1])


def whole_table(starts: torch.Tensor, nbytes: Sequence[int]) -> torch.Tensor:
    return torch.stack(
        [starts, torch.tensor(nbytes, dtype=torch.int64), torch.zeros_like(starts)], 1
    )[None]


def layer_tables(
    starts: torch.Tensor, layer_step: torch.Tensor, layer_bytes: Sequence[int], layers: int
) -> torch.Tensor:
    layer = torch.arange(layers, dtype=torch.int64)[:, None]
    size = torch.tensor(layer_bytes, dtype=torch.int64)[None, :].expand(layers, -1)
    return torch.stack([starts[None, :] + layer * layer_step[None, :], size, layer * size // 4], 2)


def host_tables(chunks: Sequence[torch.Tensor], by_layer: bool) -> torch.Tensor:
    """Staging.digest_tables for chunks the kernels reach where they are."""
    starts = torch.tensor([c.data_ptr() for c in chunks], dtype=torch.int64)
    whole = [c.numel() * c.element_size() for c in chunks]
    if not by_layer:
        return whole_table(starts, whole)
    layer = [b // c.shape[0] for b, c in zip(whole, chunks)]
    return layer_tables(starts, torch.tensor(layer, dtype=torch.int64), layer, chunks[0].shape[0])


class DigestTables:
    """Where the digest kernel reads, [rows, chunks, 3] (address, bytes, first word), gone
    up to the device in one copy (on the current stream: queue it before the chunks)."""

    def __init__(self, tables: torch.Tensor, device: torch.device, upload: bool) -> None:
        self.blocks = -(-int(tables[..., 1].max()) // 4 // DIGEST_BLOCK) if tables.numel() else 0
        tables = tables.contiguous()
        self.dev = tables.pin_memory().to(device, non_blocking=True) if upload else tables

    def add(self, out: torch.Tensor, rows: range = range(1), chunks: range | None = None) -> None:
        """Add the shares of `rows` (layers, or row 0: whole) of `chunks` to `out` (int64, per
        chunk), in one launch."""
        pick = slice(chunks.start, chunks.stop) if chunks is not None else slice(None)
        table = self.dev[rows.start : rows.stop, pick]
        n = table.shape[1]
        if table.numel() and self.blocks:
            digest_kernel[(len(rows) * n, self.blocks)](
                table.reshape(-1, 3), out[pick], n, A=DIGEST_A, B=DIGEST_B, BLOCK=DIGEST_BLOCK
            )


@dataclass(frozen=True, slots=True)
class Summing:
    """Digest tables with the sums (int64 on the device, one per chunk) they add to."""

    tables: DigestTables
    out: torch.Tensor

    def add(self, rows: range = range(1), chunks: range | None = None) -> None:
        self.tables.add(self.out, rows, chunks)


def summing(tables: DigestTables | None, out: torch.Tensor | None) -> Summing | None:
    """An upload's digest tables (None: queued without) adding to a scatter's `out`: an upload
    queued with digest tables is scattered with the sums they add to."""
    if tables is None:
        return None
    if out is None:
        raise ValueError("an upload queued with digest tables is scattered without digests")
    return Summing(tables, out)


def runs(
    chunks: Sequence[torch.Tensor],
    order: Sequence[int],
    sizes: Sequence[int],
    host: Sequence[int] | None = None,
) -> list[tuple[int, int, int]]:
    """(first chunk, count, pitch) of runs, walking `order` (chunks by host address),
    of equal-sized chunks at equal distances in one allocation (a strided copy may
    not cross from one allocation into another, even where their addresses touch).
    `host`: each chunk's address, where the caller has them."""
    host = host if host is not None else [c.data_ptr() for c in chunks]
    runs: list[tuple[int, int, int]] = []
    prev: int | None = None  # the chunk walked before `c`; None only before the first run
    prev_storage = None
    for c in order:
        storage = chunks[c].untyped_storage().data_ptr()
        if prev is not None:
            first, count, pitch = runs[-1]
            step = host[c] - host[prev]
            if (
                storage == prev_storage
                and sizes[c] == sizes[first]
                and step >= sizes[first]
                and (count == 1 or step == pitch)
            ):
                runs[-1] = (first, count + 1, step)
                prev = c
                continue
        runs.append((c, 1, sizes[c]))
        prev, prev_storage = c, storage
    return runs


def waiter(stream: torch.cuda.Stream | None, now: bool, keep: object = None) -> Callable[[], None]:
    """Waits for the work queued on `stream` so far: now, or when called (`keep` lives until
    then)."""
    if stream is None or now:
        if stream is not None:
            stream.synchronize()
        return lambda: None
    done = torch.cuda.Event()
    done.record(stream)

    def wait() -> None:
        nonlocal keep
        synchronized("copies", done)
        keep = None

    return wait


# Uploads by kernel: the copy engine takes host-to-device copies in the order they are
# queued, from every stream, so behind a bulk upload vLLM's own small input copies for its
# next step wait until the whole load has crossed (profiled inside vLLM: a layerwise load's
# forward started only after its last layer had landed). A few programs reading the pinned
# pool leave the engine free, at 0.96-0.97 of its bandwidth (`kvtier bench h2d`).
RUN_BLOCK = 8192  # int64 words (64 KB) a program of host_runs_kernel moves at a time
RUN_PROGRAMS = 32  # its programs: enough loads in flight for PCIe, most SMs left to the forward


def run_table(
    parts: Sequence[Sequence[Run]], to_host: bool = False
) -> list[tuple[torch.Tensor, int, int]] | None:
    """Each part's runs in one pinned table that `host_runs_kernel` reads over PCIe: per part
    (table, first run, runs), host to device (`to_host`: device to host). None where a row is
    not in whole, aligned int64 words (the copy engine moves those)."""
    flat = [run for part in parts for run in part]
    if any(x % 8 for run in flat for x in run[:5]):
        return None
    table = torch.tensor([_directed(run, to_host) for run in flat], dtype=torch.int64).pin_memory()
    out, first = [], 0
    for part in parts:
        out.append((table, first, len(part)))
        first += len(part)
    return out


def _directed(run: Run, to_host: bool) -> tuple[int, ...]:
    """A run as host_runs_kernel reads it: source, destination, their pitches, int64 words a
    row, rows."""
    host, dev, host_pitch, dev_pitch, width, rows = run
    ends = (dev, host, dev_pitch, host_pitch) if to_host else (host, dev, host_pitch, dev_pitch)
    return (*ends, width // 8, rows)


def copy_runs(table: torch.Tensor, first: int, runs: int, programs: int = RUN_PROGRAMS) -> None:
    """host_runs_kernel over runs [first, first + runs) of `table`, on the current stream."""
    if runs:
        host_runs_kernel[(programs,)](
            table.data_ptr() + first * 48, runs, BLOCK=RUN_BLOCK, num_warps=8
        )


class LayerEvents:
    """A layerwise scatter in flight: one CUDA event per layer."""

    def __init__(
        self,
        events: list[torch.cuda.Event],
        stream: torch.cuda.Stream,
        copies: torch.cuda.Stream,
        keepalive: object,
    ) -> None:
        self._events = events
        self._stream = stream
        self._copies = copies
        self._keepalive = keepalive

    def wait(self, layer: int) -> None:
        torch.cuda.current_stream(self._stream.device).wait_event(self._events[layer])

    def finish(self) -> None:
        """Returns once every copy out of the host chunks is done."""
        self._copies.synchronize()
        self._stream.synchronize()
        self._keepalive = None
