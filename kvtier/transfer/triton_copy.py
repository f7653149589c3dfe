"""Gather/scatter in one Triton launch for all layers of a batch of chunks.

Program (t, l*K + k) moves the H*D values of token t, layer l, K-or-V k
between the engine's KV page and chunk t // C. Layer and chunk buffers are
reached through tables of base addresses, so chunks can live anywhere the
GPU can address:

    staged (default)  kernel ⇄ one device staging buffer ⇄ pinned host
                      blocks, one strided copy per run of adjacent blocks
    direct            kernel ⇄ pinned host blocks (PCIe inside the kernel)

Whole transfers stage chunk by chunk, in a few groups of chunks, so the
kernel of one group runs while another group crosses PCIe; layerwise ones
stage layer by layer (layer l of every chunk side by side), so each layer
crosses PCIe in one copy per run and has its own kernel:

    chunk-major  | c0: L0 L1 .. | c1: L0 L1 .. |       (store, retrieve)
    layer-major  | L0: c0 c1 .. | L1: c0 c1 .. |       (layerwise)

A load's copies into staging can be queued before its slots are known
(`upload`, at the scheduler's lookup); its `scatter` then queues only the
kernels, and reads the slot table from pinned memory in a kernel of its
own (a copy-engine copy would wait behind the chunks).

In staging, chunks sit in the order of their host addresses (within a
group), so blocks that are neighbours in the pool are neighbours there too,
whatever tokens they hold: a run of them is one strided copy.

Kernels run on one side stream and PCIe copies on another, ordered by
events; both are ordered after the caller's stream, and the caller's stream
waits for them. Direct needs every chunk pinned; a call with a pageable
chunk is staged. Figures (docs/benchmarks.md): staged store/retrieve at
0.89-0.93 of pinned copy bandwidth, direct 0.84/0.75.

With a lossy codec (quant.py) the kernels quantize the KV into the chunk
rows as they gather, and dequantize as they scatter: staging, copies and
host chunks then hold the quantized bytes (about half), nothing else
changes.

Correctness is also checked on CPU with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable, Sequence

import torch
import triton
import triton.language as tl

from kvtier.codec import DIGEST_A, DIGEST_B
from kvtier.transfer import cudart
from kvtier.transfer.layout import PagedKV
from kvtier.transfer.quant import Quant

if TYPE_CHECKING:
    from kvtier.transfer import LayerHandle


@triton.jit
def _token(layer0_ptr, layer_ptrs, chunk_ptrs, slots, T, C, s_k, s_b, s_n, BS, K: tl.constexpr):
    """Program (t, l*K + k) of the copy kernels: the page of token t's K-or-V k in layer l,
    its chunk's base address (int64), its row in the chunk (layer l, k, its place in the
    chunk), and whether the token moves at all (slot -1: a token of a cut chunk that stays)."""
    t = tl.program_id(0).to(tl.int64)
    lk = tl.program_id(1).to(tl.int64)
    layer = lk // K
    k = lk % K
    slot = tl.load(slots + t).to(tl.int64)
    here = slot >= 0
    slot = tl.maximum(slot, 0)
    c = t // C
    tt = t - c * C
    n_c = tl.minimum(C, T - c * C)
    page = tl.load(layer_ptrs + layer).to(tl.pointer_type(layer0_ptr.dtype.element_ty))
    page += k * s_k + (slot // BS) * s_b + (slot % BS) * s_n
    return page, tl.load(chunk_ptrs + c), lk * n_c + tt, here


@triton.jit
def _kv_copy_kernel(
    layer0_ptr,  # typed pointer to layer 0: gives the element type
    layer_ptrs,  # int64[L]: base address of each layer's canonical view
    chunk_ptrs,  # int64[num_chunks]: base address of each chunk [L, K, n_c, H, D]
    slots,  # int64[T]; -1: skip this token
    T,
    C,  # full chunk size in tokens
    s_k,
    s_b,
    s_n,
    s_h,  # element strides of the canonical view
    BS,
    W: tl.constexpr,  # H * D
    D: tl.constexpr,
    K: tl.constexpr,
    TO_CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    page, chunk, row, here = _token(layer0_ptr, layer_ptrs, chunk_ptrs, slots, T, C, s_k, s_b, s_n, BS, K)
    width = tl.where(here, W, 0)
    chunk = chunk.to(tl.pointer_type(layer0_ptr.dtype.element_ty)) + row * W
    for w0 in range(0, W, BLOCK):
        w = w0 + tl.arange(0, BLOCK)
        mask = w < width
        src_off = (w // D) * s_h + (w % D)
        if TO_CHUNK:
            tl.store(chunk + w, tl.load(page + src_off, mask=mask), mask=mask)
        else:
            tl.store(page + src_off, tl.load(chunk + w, mask=mask), mask=mask)


@triton.jit
def _kv_quant_copy_kernel(
    layer0_ptr, layer_ptrs, chunk_ptrs, slots, T, C, s_k, s_b, s_n, s_h, BS,  # as in _kv_copy_kernel
    NH: tl.constexpr,
    D: tl.constexpr,
    NHP: tl.constexpr,  # NH and D rounded up to powers of two: the tile of one token's heads
    DP: tl.constexpr,
    K: tl.constexpr,
    TO_CHUNK: tl.constexpr,  # True: quantize page -> chunk row; False: dequantize chunk row -> page
    FP8: tl.constexpr,
    QMAX: tl.constexpr,
):
    """Program (t, l*K + k): token t's row of layer l, K-or-V k, in a quantized
    chunk (quant.py): NH*D one-byte values, then NH float32 scales."""
    page, chunk, r, here = _token(layer0_ptr, layer_ptrs, chunk_ptrs, slots, T, C, s_k, s_b, s_n, BS, K)
    heads_here = tl.where(here, NH, 0)
    elem_ty = layer0_ptr.dtype.element_ty
    row = chunk.to(tl.pointer_type(tl.uint8)) + r * (NH * D + 4 * NH)
    scales = (row + NH * D).to(tl.pointer_type(tl.float32))
    heads = tl.arange(0, NHP)
    h = heads[:, None]
    d = tl.arange(0, DP)[None, :]
    mask = (h < heads_here) & (d < D)
    head_mask = heads < heads_here
    if TO_CHUNK:
        x = tl.load(page + h * s_h + d, mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=1)
        inv = tl.where(amax > 0, QMAX / amax, 0.0)
        y = tl.minimum(tl.maximum(x * inv[:, None], -QMAX), QMAX)
        if FP8:
            q = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:
            q = tl.floor(y + 0.5).to(tl.int8).to(tl.uint8, bitcast=True)
        tl.store(row + h * D + d, q, mask=mask)
        tl.store(scales + heads, amax / QMAX, mask=head_mask)
    else:
        q = tl.load(row + h * D + d, mask=mask, other=0)
        if FP8:
            v = q.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            v = q.to(tl.int8, bitcast=True).to(tl.float32)
        s = tl.load(scales + heads, mask=head_mask, other=0.0)
        tl.store(page + h * s_h + d, (v * s[:, None]).to(elem_ty), mask=mask)


@triton.jit
def _digest_kernel(
    table,  # int64[rows, 3]: per slice its address, its bytes, and the index of its first word in its chunk
    out,  # int64[n]: slice c's share of its chunk's digest is added to out[c % n] (mod 2^64)
    n,  # chunks: the table holds one slice of each, or of each for several layers in turn
    A: tl.constexpr,
    B: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """codec.kv_digest of slices: program (c, b) sums words [b*BLOCK, (b+1)*BLOCK) of slice c."""
    c = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1).to(tl.int64) * BLOCK
    words = tl.load(table + c * 3 + 1) // 4
    if start < words:
        base = tl.load(table + c * 3).to(tl.pointer_type(tl.uint32))
        first = tl.load(table + c * 3 + 2)
        idx = start + tl.arange(0, BLOCK).to(tl.int64)
        mask = idx < words
        w = tl.load(base + idx, mask=mask, other=0).to(tl.int64)  # zero-extended
        weight = ((first + idx) * A + B) | 1  # int64 arithmetic wraps: the same bits as the u64 sum
        tl.atomic_add(out + c % n, tl.sum(tl.where(mask, (w + 1) * weight, 0), axis=0))


@triton.jit
def _host_words_kernel(src, dst, n, BLOCK: tl.constexpr):
    """dst[i] = src[i], int64 words, `src` the address of pinned host memory: the kernel
    reads it over PCIe, where a copy-engine copy would queue behind chunks already crossing."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    tl.store(dst + i, tl.load(src.to(tl.pointer_type(tl.int64)) + i, mask=mask), mask=mask)


class _Staging:
    """Device memory for the chunks of one transfer, and the copies between it and them.

    Chunks are split into `groups` by token order; within a group they are
    laid out in the order of their host addresses, and `runs` of them
    (equal sizes, equal distances apart in one host allocation: adjacent
    pool blocks) cross PCIe in one strided copy, whole or one layer at a time.
    """

    def __init__(self, chunks: Sequence[torch.Tensor], device: torch.device, layer_major: bool,
                 groups: int = 1) -> None:
        self.chunks = list(chunks)
        n = len(self.chunks)
        self.chunk_bytes = [c.numel() * c.element_size() for c in chunks]
        self.layer_bytes = [b // c.shape[0] for b, c in zip(self.chunk_bytes, chunks)]
        self.flat = torch.empty(sum(self.chunk_bytes), dtype=torch.uint8, device=device)
        size = (-(-n // groups)) if groups > 1 else n
        self.groups = [range(a, min(a + size, n)) for a in range(0, n, size)]
        order = [c for g in self.groups for c in sorted(g, key=lambda c: self.chunks[c].data_ptr())]
        self.runs = [_runs(self.chunks, [c for c in order if c in g], self.chunk_bytes) for g in self.groups]
        # Byte offset of each chunk's slot, in staging order.
        unit = self.layer_bytes if layer_major else self.chunk_bytes
        start = [0] * n
        total = 0
        for c in order:
            start[c] = total
            total += unit[c]
        base = self.flat.data_ptr()
        self._start = base + torch.tensor(start, dtype=torch.int64)
        # Layer-major: layer l of every chunk follows layer l-1 of every chunk.
        # Chunk-major: layer l of a chunk follows its layer l-1.
        self._layer_step = torch.tensor(self.layer_bytes, dtype=torch.int64)
        if layer_major:
            self._layer_step = torch.full_like(self._layer_step, total)

    def _at(self, layer: int, chunk: int) -> int:
        return int(self._start[chunk] + layer * self._layer_step[chunk])

    def ptrs(self, layers: range) -> torch.Tensor:
        """[len(layers), chunks] device addresses of each layer of each chunk."""
        return self._start[None, :] + torch.arange(layers.start, layers.stop)[:, None] * self._layer_step[None, :]

    def digest_tables(self, by_layer: bool) -> torch.Tensor:
        """(address, bytes, first word) of each chunk in staging: [1, chunks, 3] whole,
        or [L, chunks, 3] layer by layer (layer-major staging), for _DigestTables."""
        if not by_layer:
            return _whole_table(self._start, self.chunk_bytes)
        return _layer_tables(self._start, self._layer_step, self.layer_bytes, self.chunks[0].shape[0])

    def copy(self, to_host: bool, stream: torch.cuda.Stream, layer: int | None = None, group: int = 0) -> None:
        """Whole chunks of a group (chunk-major) or one layer (layer-major), between staging and host."""
        for first, count, pitch in self.runs[group]:
            width = self.chunk_bytes[first] if layer is None else self.layer_bytes[first]
            host = self.chunks[first].data_ptr() + (0 if layer is None else layer * width)
            dev = self._at(0 if layer is None else layer, first)
            # A run's chunks are neighbours in staging: its device-side rows are `width` apart.
            if to_host:
                cudart.memcpy2d(host, pitch, dev, width, width, count, stream)
            else:
                cudart.memcpy2d(dev, width, host, pitch, width, count, stream)


class Upload:
    """Host chunks on their way into device staging: their copies queued on the copy
    stream, before the slots they go to are known (a hit, at the scheduler's lookup). A
    scatter given it queues only its kernels; the staging lives as long as this does."""

    def __init__(self, staging: _Staging, ptrs: torch.Tensor, sums: _DigestTables | None,
                 landed: list[torch.cuda.Event], layer_major: bool) -> None:
        self.staging, self.ptrs, self.sums, self.landed, self.layer_major = staging, ptrs, sums, landed, layer_major

    def chunks(self) -> list[torch.Tensor]:
        return self.staging.chunks

    def wait(self) -> None:
        """Return once the host chunks are no longer read (they may be released)."""
        if self.landed:
            self.landed[-1].synchronize()  # one copy stream: the last copy queued ends last


def _whole_table(starts: torch.Tensor, nbytes: Sequence[int]) -> torch.Tensor:
    return torch.stack([starts, torch.tensor(nbytes, dtype=torch.int64), torch.zeros_like(starts)], 1)[None]


def _layer_tables(starts: torch.Tensor, layer_step: torch.Tensor, layer_bytes: Sequence[int], layers: int
                  ) -> torch.Tensor:
    layer = torch.arange(layers, dtype=torch.int64)[:, None]
    size = torch.tensor(layer_bytes, dtype=torch.int64)[None, :].expand(layers, -1)
    return torch.stack([starts[None, :] + layer * layer_step[None, :], size, layer * size // 4], 2)


def _host_tables(chunks: Sequence[torch.Tensor], by_layer: bool) -> torch.Tensor:
    """Staging.digest_tables for chunks the kernels reach where they are."""
    starts = torch.tensor([c.data_ptr() for c in chunks], dtype=torch.int64)
    whole = [c.numel() * c.element_size() for c in chunks]
    if not by_layer:
        return _whole_table(starts, whole)
    layer = [b // c.shape[0] for b, c in zip(whole, chunks)]
    return _layer_tables(starts, torch.tensor(layer, dtype=torch.int64), layer, chunks[0].shape[0])


class _DigestTables:
    """Where the digest kernel reads, [rows, chunks, 3] (address, bytes, first word), gone
    up to the device in one copy (on the current stream: queue it before the chunks)."""

    def __init__(self, tables: torch.Tensor, device: torch.device, upload: bool) -> None:
        self.blocks = -(-int(tables[..., 1].max()) // 4 // DIGEST_BLOCK) if tables.numel() else 0
        tables = tables.contiguous()
        self.dev = tables.pin_memory().to(device, non_blocking=True) if upload else tables

    def add(self, out: torch.Tensor, rows: range = range(1), chunks: range | None = None) -> None:
        """Add the shares of `rows` (layers, or row 0: whole) of `chunks` to `out` (int64, per chunk),
        in one launch."""
        pick = slice(chunks.start, chunks.stop) if chunks is not None else slice(None)
        table = self.dev[rows.start : rows.stop, pick]
        n = table.shape[1]
        if table.numel() and self.blocks:
            _digest_kernel[(len(rows) * n, self.blocks)](table.reshape(-1, 3), out[pick], n,
                                                         A=DIGEST_A, B=DIGEST_B, BLOCK=DIGEST_BLOCK)


def _runs(chunks: Sequence[torch.Tensor], order: Sequence[int], sizes: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first chunk, count, pitch) of runs, walking `order` (chunks by host address),
    of equal-sized chunks at equal distances in one allocation (a strided copy may
    not cross from one allocation into another, even where their addresses touch)."""
    runs: list[tuple[int, int, int]] = []
    prev = None
    for c in order:
        chunk = chunks[c]
        if runs:
            first, count, pitch = runs[-1]
            step = chunk.data_ptr() - chunks[prev].data_ptr()
            same = chunk.untyped_storage().data_ptr() == chunks[prev].untyped_storage().data_ptr()
            if same and sizes[c] == sizes[first] and step >= sizes[first] and (count == 1 or step == pitch):
                runs[-1] = (first, count + 1, step)
                prev = c
                continue
        runs.append((c, 1, sizes[c]))
        prev = c
    return runs


def _waiter(stream: torch.cuda.Stream | None, now: bool, keep: object = None) -> Callable[[], None]:
    """Waits for the work queued on `stream` so far: now, or when called (`keep` lives until then)."""
    if stream is None or now:
        if stream is not None:
            stream.synchronize()
        return lambda: None
    done = torch.cuda.Event()
    done.record(stream)

    def wait() -> None:
        nonlocal keep
        done.synchronize()
        keep = None

    return wait


GROUPS = 4  # whole transfers: kernel of group g+1 runs while group g crosses PCIe
DIGEST_BLOCK = 4096  # words per program of _digest_kernel
DIGEST_LAYERS = 8  # layers summed per digest launch of a layerwise scatter
SLOT_BLOCK = 1024  # slot-table words per program of _host_words_kernel


class TritonTransfer:
    """Triton gather/scatter; `direct` kernels touch pinned host chunks."""

    name = "triton"

    def __init__(self, kv: PagedKV, *, direct: bool = False, quant: Quant | None = None) -> None:
        self.kv = kv
        self.direct = direct
        self.quant = quant
        first = kv.layers[0]
        self._strides = first.stride()[:4]
        self._layer_ptrs = torch.tensor(
            [t.data_ptr() for t in kv.layers], dtype=torch.int64, device=kv.device
        )
        # Per-layer launches pass one of these; slicing anew per launch is host time
        # in front of a forward pass that is itself host-bound.
        self._one_layer = [self._layer_ptrs[i : i + 1] for i in range(kv.num_layers)]
        w = kv.heads * kv.head_size
        self._block = min(triton.next_power_of_2(w), 4096)
        on_cuda = kv.device.type == "cuda"
        self._stream = torch.cuda.Stream(kv.device) if on_cuda else None  # kernels
        self._copies = torch.cuda.Stream(kv.device) if on_cuda else None  # PCIe copies
        if on_cuda and not cudart.available():
            raise RuntimeError("the Triton transfer needs cudaMemcpy2DAsync from the CUDA runtime torch loaded, "
                               "and found no libcudart in this process; use transfer='torch'")

    # -- building blocks -----------------------------------------------------------

    def _upload(self, slots: torch.Tensor, ptrs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Device copies of the slot and address tables. On a GPU they go up
        from pinned memory: an upload from pageable memory would make the
        host wait for everything queued on the stream before it."""
        slots = slots.to(torch.int64)
        if self.kv.device.type == "cuda":
            slots, ptrs = slots.pin_memory(), ptrs.pin_memory()
        return slots.to(self.kv.device, non_blocking=True), ptrs.to(self.kv.device, non_blocking=True)

    def _kernel(self, slots: torch.Tensor, ptrs: torch.Tensor, chunk_size: int, to_chunk: bool, layers: range) -> None:
        """One launch over `layers`; ptrs[c] is where chunk c's first layer of `layers` is."""
        kv = self.kv
        total = slots.numel()
        s_k, s_b, s_n, s_h = self._strides
        grid = (total, len(layers) * kv.kv)
        tables = self._one_layer[layers.start] if len(layers) == 1 else self._layer_ptrs[layers.start : layers.stop]
        if self.quant is not None:
            q = self.quant
            _kv_quant_copy_kernel[grid](
                kv.layers[0], tables, ptrs, slots, total, chunk_size, s_k, s_b, s_n, s_h, kv.block_size,
                NH=kv.heads, D=kv.head_size, NHP=triton.next_power_of_2(kv.heads),
                DP=triton.next_power_of_2(kv.head_size), K=kv.kv, TO_CHUNK=to_chunk, FP8=q.name == "fp8",
                QMAX=q.qmax,
            )
            return
        _kv_copy_kernel[grid](
            kv.layers[0], tables, ptrs, slots, total, chunk_size,
            s_k, s_b, s_n, s_h, kv.block_size, kv.heads * kv.head_size, kv.head_size,
            K=kv.kv, TO_CHUNK=to_chunk, BLOCK=self._block,
        )

    def _host_ptrs(self, chunks: Sequence[torch.Tensor], layers: range) -> torch.Tensor:
        starts = torch.tensor([c.data_ptr() for c in chunks], dtype=torch.int64)
        layer_bytes = torch.tensor([c[0].numel() * c.element_size() for c in chunks], dtype=torch.int64)
        return starts[None, :] + torch.arange(layers.start, layers.stop)[:, None] * layer_bytes[None, :]

    def _digest_tables(self, tables: torch.Tensor) -> _DigestTables:
        return _DigestTables(tables, self.kv.device, upload=self._stream is not None)

    def _staged(self, chunks: Sequence[torch.Tensor]) -> bool:
        """Chunks in host memory that the kernel should not touch across PCIe."""
        if self._stream is None or chunks[0].is_cuda:
            return False
        return not (self.direct and all(c.is_pinned() for c in chunks))

    def _layerwise_tables(self, slots: torch.Tensor, chunks: Sequence[torch.Tensor]
                          ) -> tuple[_Staging | None, torch.Tensor, torch.Tensor]:
        """Layer-major staging (None where the kernel reaches the chunks itself)
        and the device slot table and [layer, chunk] address table; on the
        current stream."""
        layers = range(self.kv.num_layers)
        staging = _Staging(chunks, self.kv.device, layer_major=True) if self._staged(chunks) else None
        dev_slots, ptrs = self._upload(slots, staging.ptrs(layers) if staging else self._host_ptrs(chunks, layers))
        return staging, dev_slots, ptrs

    def _in_place(self, slots: torch.Tensor, chunks: Sequence[torch.Tensor], to_chunk: bool, layers: range,
                  digests: torch.Tensor | None = None) -> None:
        """Chunks the kernel reaches itself (device memory, the interpreter, pinned with `direct`):
        one launch on the current stream (and the digests of the chunks, whole)."""
        dev_slots, ptrs = self._upload(slots, self._host_ptrs(chunks, range(layers.start, layers.start + 1)))
        sums = self._digest_tables(_host_tables(chunks, by_layer=False)) if digests is not None else None
        if sums is not None and not to_chunk:
            sums.add(digests)
        self._kernel(dev_slots, ptrs[0], chunks[0].shape[2], to_chunk, layers)
        if sums is not None and to_chunk:
            sums.add(digests)

    # -- whole transfers -------------------------------------------------------------

    def gather(self, slots: torch.Tensor, chunks: Sequence[torch.Tensor], digests: torch.Tensor | None = None) -> None:
        """Fill `chunks` with the KV of `slots`; returns once the bytes have landed.
        `digests` (int64 zeros on the device, one per chunk): their KV digests are added there."""
        layers = range(self.kv.num_layers)
        if not self._staged(chunks):
            self._unstaged(lambda: self._in_place(slots, chunks, True, layers, digests), chunks)
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.kv.device))
        with torch.cuda.stream(self._stream):
            staging = _Staging(chunks, self.kv.device, layer_major=False, groups=GROUPS)
            dev_slots, ptrs = self._upload(slots, staging.ptrs(range(1))[0])
            sums = self._digest_tables(staging.digest_tables(by_layer=False)) if digests is not None else None
            size = chunks[0].shape[2]
            for g, group in enumerate(staging.groups):
                a, b = group.start * size, min(group.stop * size, slots.numel())
                self._kernel(dev_slots[a:b], ptrs[group.start : group.stop], size, True, layers)
                if sums is not None:
                    sums.add(digests, chunks=group)
                self._copies.wait_stream(self._stream)
                staging.copy(to_host=True, stream=self._copies, group=g)
        self._copies.synchronize()

    def upload(self, chunks: Sequence[torch.Tensor], layer_major: bool = False, digests: bool = False
               ) -> Upload | None:
        """Queue the copies of host chunks into device staging now, chunk-major in groups (for
        `scatter`) or layer by layer (for `scatter_layerwise`); None where the kernels read
        the chunks where they are. The caller's stream is not waited for: staging is this
        transfer's own memory. `digests`: their tables go up too (for a scatter's `digests`)."""
        if not self._staged(chunks):
            return None
        with torch.cuda.device(self.kv.device):  # the caller may be a thread whose current device is another
            self._copies.wait_stream(self._stream)  # staging memory may still be read by earlier kernels
            with torch.cuda.stream(self._stream):
                staging = _Staging(chunks, self.kv.device, layer_major=layer_major,
                                   groups=1 if layer_major else GROUPS)
                # The tables go up first: the copy engine takes host-to-device copies in the
                # order they are queued, so tables queued behind the chunks would hold every
                # kernel until all chunks had crossed (the slots: _slots_up).
                layers = range(self.kv.num_layers)
                table = staging.ptrs(layers) if layer_major else staging.ptrs(range(1))[0]
                ptrs = table.pin_memory().to(self.kv.device, non_blocking=True)
                sums = self._digest_tables(staging.digest_tables(by_layer=layer_major)) if digests else None
                landed = []
                for part in (layers if layer_major else range(len(staging.groups))):
                    if layer_major:
                        staging.copy(to_host=False, stream=self._copies, layer=part)
                    else:
                        staging.copy(to_host=False, stream=self._copies, group=part)
                    landed.append(torch.cuda.Event())
                    landed[-1].record(self._copies)
        return Upload(staging, ptrs, sums, landed, layer_major)

    def _slots_up(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The slot table on the device, on the current stream, read from pinned memory by a
        kernel (an Upload's chunks may be crossing on the copy engine); and the pinned
        table, to keep until that kernel has run."""
        host = slots.to(torch.int64).contiguous().pin_memory()
        dev = torch.empty(host.shape, dtype=torch.int64, device=self.kv.device)
        if host.numel():
            _host_words_kernel[(triton.cdiv(host.numel(), SLOT_BLOCK),)](host.data_ptr(), dev, host.numel(),
                                                                         BLOCK=SLOT_BLOCK)
        return dev, host

    def scatter(self, slots: torch.Tensor, chunks: Sequence[torch.Tensor], layers: range | None = None,
                wait: bool = True, digests: torch.Tensor | None = None, upload: Upload | None = None
                ) -> Callable[[], None]:
        """Write `chunks` into the KV pages; the current stream is ordered after it.

        `layers` (device-resident or interpreter chunks only) limits the write to those layers.
        `digests` (int64 zeros on the device, one per chunk): the KV digests of the
        bytes as they arrived are added there (readable on the current stream).
        `upload`: these chunks' `upload()`, queued earlier (then only the kernels are queued).
        Returns what waits for the copies out of the host chunks (done already with `wait`)."""
        layers = layers or range(self.kv.num_layers)
        if not self._staged(chunks):
            return self._unstaged(lambda: self._in_place(slots, chunks, False, layers, digests), chunks, wait)
        if len(layers) != self.kv.num_layers:
            raise ValueError("a layer range is for device-resident chunks; use scatter_layerwise")
        if upload is None:
            upload = self.upload(chunks, digests=digests is not None)
        elif upload.layer_major:
            raise ValueError("a layer-major upload is for scatter_layerwise")
        current = torch.cuda.current_stream(self.kv.device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            dev_slots, host_slots = self._slots_up(slots)
            size = chunks[0].shape[2]
            for group, event in zip(upload.staging.groups, upload.landed):
                self._stream.wait_event(event)
                if upload.sums is not None:
                    upload.sums.add(digests, chunks=group)
                a, b = group.start * size, min(group.stop * size, slots.numel())
                self._kernel(dev_slots[a:b], upload.ptrs[group.start : group.stop], size, False, layers)
        current.wait_stream(self._stream)
        # The caller releases the host blocks once the copies out of them are done (the kernels
        # waited for them); staging and the pinned slot table live until then.
        return _waiter(self._stream, wait, keep=(upload, host_slots))

    def _unstaged(self, work, chunks: Sequence[torch.Tensor], wait: bool = True) -> Callable[[], None]:
        """Device chunks (and the interpreter's): on the current stream.
        `direct` host chunks: on the side stream, waited for (now or by the
        returned function), since the caller frees or reads the chunks next."""
        if self._stream is None or chunks[0].is_cuda:
            work()
            return _waiter(None, True)
        current = torch.cuda.current_stream(self.kv.device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            work()
        current.wait_stream(self._stream)
        return _waiter(self._stream, wait)

    # -- layer by layer ------------------------------------------------------------------

    def scatter_layerwise(self, slots: torch.Tensor, chunks: Sequence[torch.Tensor],
                          digests: torch.Tensor | None = None, upload: Upload | None = None) -> LayerHandle:
        """Start writing `chunks` layer by layer; wait(l) orders the caller after layer l.

        Every layer's work is queued at once: layer l of every chunk crosses
        PCIe on the copy stream (one copy per run), then its kernel runs on
        the kernel stream, while layer l+1 crosses. The caller's stream waits
        only for the layer it is about to use. Direct: one kernel per layer
        reads the pinned chunks. `digests`: as in `scatter`, layer by layer
        (complete once `finish()` returns). `upload`: these chunks'
        `upload(layer_major=True)`, queued earlier.
        """
        if self._stream is None:
            if digests is not None:
                raise ValueError("digests are computed on a CUDA device")
            from kvtier.transfer.torch_copy import LazyLayers

            return LazyLayers(self, slots, chunks)
        if upload is None:
            upload = self.upload(chunks, layer_major=True, digests=digests is not None)
        elif not upload.layer_major:
            raise ValueError("a chunk-major upload is for scatter")
        self._stream.wait_stream(torch.cuda.current_stream(self.kv.device))
        layers = range(self.kv.num_layers)
        events, keep = [], None
        with torch.cuda.stream(self._stream):
            if upload is not None:
                dev_slots, keep = self._slots_up(slots)
                ptrs, sums = upload.ptrs, upload.sums
            else:  # the kernels read the chunks where they are
                _, dev_slots, ptrs = self._layerwise_tables(slots, chunks)
                sums = None if digests is None else self._digest_tables(_host_tables(chunks, by_layer=True))
            summed = 0  # layers whose digests are queued
            for layer, row in zip(layers, ptrs.unbind(0)):
                if upload is not None:
                    self._stream.wait_event(upload.landed[layer])
                self._kernel(dev_slots, row, chunks[0].shape[2], False, range(layer, layer + 1))
                events.append(torch.cuda.Event())
                events[-1].record(self._stream)
                if sums is not None and (layer + 1 - summed == DIGEST_LAYERS or layer >= layers[-1] - 1):
                    # Behind the layer's event, so that no forward waits for it; several layers per
                    # launch (each launch is host time in front of the forward), the last one alone
                    # (what runs after the last layer lands, `finish()` waits for).
                    sums.add(digests, rows=range(summed, layer + 1))
                    summed = layer + 1
        return LayerEvents(events, self._stream, self._copies, (upload, keep))

    def gather_layerwise(self, slots: torch.Tensor, chunks: Sequence[torch.Tensor],
                         digests: torch.Tensor | None = None) -> LayerSaves:
        """A gather the caller drives layer by layer: `save(l)` once layer l's
        KV is written (on the current stream) queues its gather and copy to
        the host behind it; `finish()` returns once the saved layers have landed.
        `digests`: as in `gather`, complete (if every layer was saved) after `finish()`."""
        return LayerSaves(self, slots, chunks, digests)


class LayerEvents:
    """A layerwise scatter in flight: one CUDA event per layer."""

    def __init__(self, events: list, stream, copies, keepalive: object) -> None:
        self._events, self._stream, self._copies, self._keepalive = events, stream, copies, keepalive

    def wait(self, layer: int) -> None:
        torch.cuda.current_stream(self._stream.device).wait_event(self._events[layer])

    def finish(self) -> None:
        """Returns once every copy out of the host chunks is done."""
        self._copies.synchronize()
        self._stream.synchronize()
        self._keepalive = None


class LayerSaves:
    """A layerwise gather: layer l moves when `save(l)` says it is computed."""

    def __init__(self, transfer: TritonTransfer, slots: torch.Tensor, chunks: Sequence[torch.Tensor],
                 digests: torch.Tensor | None = None) -> None:
        self._t, self._chunks, self._digests, self._sums = transfer, list(chunks), digests, None
        self._saved = [False] * transfer.kv.num_layers
        self._stream = transfer._stream
        # The interpreter has no stream: its kernels write the host chunks directly.
        with torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
            self._staging, self._slots, self._ptrs = transfer._layerwise_tables(slots, chunks)
            if digests is not None:
                self._sums = transfer._digest_tables(self._staging.digest_tables(by_layer=True) if self._staging
                                                     else _host_tables(self._chunks, by_layer=True))

    def save(self, layer: int) -> None:
        if self._saved[layer]:
            return
        self._saved[layer] = True
        t, n_c = self._t, self._chunks[0].shape[2]
        if self._stream is None:
            t._kernel(self._slots, self._ptrs[layer], n_c, True, range(layer, layer + 1))
            if self._sums is not None:
                self._sums.add(self._digests, rows=range(layer, layer + 1))
            return
        self._stream.wait_stream(torch.cuda.current_stream(t.kv.device))
        with torch.cuda.stream(self._stream):
            t._kernel(self._slots, self._ptrs[layer], n_c, True, range(layer, layer + 1))
            if self._sums is not None:
                self._sums.add(self._digests, rows=range(layer, layer + 1))
        if self._staging:
            t._copies.wait_stream(self._stream)
            self._staging.copy(to_host=True, stream=t._copies, layer=layer)

    def finish(self) -> None:
        """Every saved layer in the host chunks."""
        if self._stream is not None:
            self._stream.synchronize()
            self._t._copies.synchronize()
        self._staging = None

    def unsaved(self) -> list[int]:
        return [layer for layer, saved in enumerate(self._saved) if not saved]
