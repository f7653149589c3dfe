"""Gather/scatter in one Triton launch for all layers of a batch of chunks.

Program (t, l*K + k) moves the H*D values of token t, layer l, K-or-V k
between the engine's KV page and chunk t // C. Layer and chunk buffers are
reached through tables of base addresses, so chunks can live anywhere the
GPU can address:

    staged (default)  kernel ⇄ one device staging buffer, then one bulk
                      copy per chunk ⇄ pinned host blocks
    direct            kernel ⇄ pinned host blocks (PCIe inside the kernel)

Measured on an H200 (docs/benchmarks.md): staged 0.91/0.92 of pinned copy
bandwidth for store/retrieve, direct 0.84/0.78. Direct needs every chunk
pinned; a call with a pageable chunk is staged. Work runs on a side stream
ordered after the caller's; the caller's stream waits on it.

Correctness is also checked on CPU with TRITON_INTERPRET=1.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from kvtier.transfer.layout import PagedKV


@triton.jit
def _kv_copy_kernel(
    layer0_ptr,  # typed pointer to layer 0: gives the element type
    layer_ptrs,  # int64[L]: base address of each layer's canonical view
    chunk_ptrs,  # int64[num_chunks]: base address of each chunk [L, K, n_c, H, D]
    slots,  # int64[T]
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
    t = tl.program_id(0).to(tl.int64)
    lk = tl.program_id(1).to(tl.int64)
    layer = lk // K
    k = lk % K
    slot = tl.load(slots + t).to(tl.int64)
    c = t // C
    tt = t - c * C
    n_c = tl.minimum(C, T - c * C)
    elem_ty = layer0_ptr.dtype.element_ty
    page = tl.load(layer_ptrs + layer).to(tl.pointer_type(elem_ty))
    page += k * s_k + (slot // BS) * s_b + (slot % BS) * s_n
    chunk = tl.load(chunk_ptrs + c).to(tl.pointer_type(elem_ty))
    chunk += (lk * n_c + tt) * W
    for w0 in range(0, W, BLOCK):
        w = w0 + tl.arange(0, BLOCK)
        mask = w < W
        src_off = (w // D) * s_h + (w % D)
        if TO_CHUNK:
            tl.store(chunk + w, tl.load(page + src_off, mask=mask), mask=mask)
        else:
            tl.store(page + src_off, tl.load(chunk + w, mask=mask), mask=mask)


class TritonTransfer:
    """Triton gather/scatter; `direct` kernels touch pinned host chunks."""

    name = "triton"

    def __init__(self, kv: PagedKV, *, direct: bool = False) -> None:
        self.kv = kv
        self.direct = direct
        first = kv.layers[0]
        self._strides = first.stride()[:4]
        self._layer_ptrs = torch.tensor(
            [t.data_ptr() for t in kv.layers], dtype=torch.int64, device=kv.device
        )
        w = kv.heads * kv.head_size
        self._block = min(triton.next_power_of_2(w), 4096)
        on_cuda = kv.device.type == "cuda"
        self._stream = torch.cuda.Stream(kv.device) if on_cuda else None

    def _tables(self, slots: torch.Tensor, chunks: Sequence[torch.Tensor], layers: range) -> tuple[torch.Tensor, torch.Tensor]:
        """Device copies of `slots` and of the chunk addresses at each layer of
        `layers` ([len(layers), num_chunks]). On a GPU they go up from pinned
        memory: an upload from pageable memory would make the host wait for
        everything queued on the stream before it."""
        sizes = [c[0].numel() * c.element_size() for c in chunks]  # bytes of one layer of each chunk
        ptrs = torch.tensor([[c.data_ptr() + l * n for c, n in zip(chunks, sizes)] for l in layers],
                            dtype=torch.int64)
        slots = slots.to(torch.int64)
        if self.kv.device.type == "cuda":
            ptrs, slots = ptrs.pin_memory(), slots.pin_memory()
        return slots.to(self.kv.device, non_blocking=True), ptrs.to(self.kv.device, non_blocking=True)

    def _launch(self, slots: torch.Tensor, chunks: Sequence[torch.Tensor], to_chunk: bool) -> None:
        """One launch over all layers of every chunk."""
        dev_slots, ptrs = self._tables(slots, chunks, range(1))
        self._kernel(dev_slots, ptrs[0], chunks[0].shape[2], to_chunk, range(self.kv.num_layers))

    def _kernel(self, slots: torch.Tensor, ptrs: torch.Tensor, chunk_size: int, to_chunk: bool, layers: range) -> None:
        kv = self.kv
        total = slots.numel()
        s_k, s_b, s_n, s_h = self._strides
        grid = (total, len(layers) * kv.kv)
        _kv_copy_kernel[grid](
            kv.layers[0], self._layer_ptrs[layers.start : layers.stop], ptrs, slots, total, chunk_size,
            s_k, s_b, s_n, s_h, kv.block_size, kv.heads * kv.head_size, kv.head_size,
            K=kv.kv, TO_CHUNK=to_chunk, BLOCK=self._block,
        )

    def _staging(self, chunks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """One device buffer, viewed as one tensor per chunk."""
        sizes = [c.numel() for c in chunks]
        flat = torch.empty(sum(sizes), dtype=self.kv.dtype, device=self.kv.device)
        return [v.view(c.shape) for v, c in zip(flat.split(sizes), chunks)]

    def _direct_ok(self, chunks: Sequence[torch.Tensor]) -> bool:
        return self.direct and all(c.is_pinned() for c in chunks)

    def gather(self, slots: torch.Tensor, chunks: Sequence[torch.Tensor]) -> None:
        """Fill `chunks` with the KV of `slots`; returns once the bytes have landed."""
        if self._stream is None or chunks[0].is_cuda:
            self._launch(slots, chunks, to_chunk=True)
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.kv.device))
        with torch.cuda.stream(self._stream):
            if self._direct_ok(chunks):
                self._launch(slots, chunks, to_chunk=True)
            else:
                staged = self._staging(chunks)
                self._launch(slots, staged, to_chunk=True)
                for host, dev in zip(chunks, staged):
                    host.copy_(dev, non_blocking=True)
        self._stream.synchronize()

    def scatter(self, slots: torch.Tensor, chunks: Sequence[torch.Tensor], layers: range | None = None) -> None:
        """Write `chunks` into the KV pages; the current stream is ordered after it."""
        if layers is not None:
            if self._stream is not None and not chunks[0].is_cuda:
                raise ValueError("a layer range is for device-resident chunks; use scatter_layerwise")
            dev_slots, ptrs = self._tables(slots, chunks, range(layers.start, layers.start + 1))
            self._kernel(dev_slots, ptrs[0], chunks[0].shape[2], False, layers)
            return
        if self._stream is None or chunks[0].is_cuda:
            self._launch(slots, chunks, to_chunk=False)
            return
        current = torch.cuda.current_stream(self.kv.device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            if self._direct_ok(chunks):
                self._launch(slots, chunks, to_chunk=False)
            else:
                staged = self._staging(chunks)
                for dev, host in zip(staged, chunks):
                    dev.copy_(host, non_blocking=True)
                self._launch(slots, staged, to_chunk=False)
        current.wait_stream(self._stream)
        # The caller releases the host blocks once this returns, so the copies
        # out of them must be done.
        self._stream.synchronize()

    def scatter_layerwise(self, slots: torch.Tensor, chunks: Sequence[torch.Tensor]) -> LayerEvents:
        """Start writing `chunks` layer by layer; wait(l) orders the caller after layer l.

        Every layer's work is queued at once on the side stream; the caller's
        stream waits only for the layer it is about to use. Direct: one kernel
        per layer reads the pinned chunks. Staged: each layer's slices cross
        PCIe to a staging buffer, then its kernel runs.
        """
        if self._stream is None:
            from kvtier.transfer.torch_copy import LazyLayers

            return LazyLayers(self, slots, chunks)
        current = torch.cuda.current_stream(self.kv.device)
        self._stream.wait_stream(current)
        direct = self._direct_ok(chunks)
        staged = [] if direct else self._staging(chunks)
        source = chunks if direct else staged
        layers = range(self.kv.num_layers)
        events = []
        with torch.cuda.stream(self._stream):
            dev_slots, ptrs = self._tables(slots, source, layers)
            for layer in layers:
                for dev, host in zip(staged, chunks):
                    dev[layer].copy_(host[layer], non_blocking=True)
                self._kernel(dev_slots, ptrs[layer], chunks[0].shape[2], False, range(layer, layer + 1))
                events.append(torch.cuda.Event())
                events[-1].record(self._stream)
        return LayerEvents(events, self._stream, staged)


class LayerEvents:
    """A layerwise scatter in flight: one CUDA event per layer."""

    def __init__(self, events: list, stream, keepalive: list[torch.Tensor]) -> None:
        self._events, self._stream, self._keepalive = events, stream, keepalive

    def wait(self, layer: int) -> None:
        torch.cuda.current_stream(self._stream.device).wait_event(self._events[layer])

    def finish(self) -> None:
        """Returns once every copy out of the host chunks is done."""
        self._stream.synchronize()
        self._keepalive = []
