"""Gather/scatter in one Triton launch for all layers of a batch of chunks.

Program (t, l*K + k) moves the H*D values of token t, layer l, K-or-V k between the engine's
KV page and chunk t // C. Layer and chunk buffers are reached through tables of base
addresses, so chunks can live anywhere the GPU can address:

    staged (default)  kernel ⇄ one device staging buffer ⇄ pinned host
                      blocks, one strided copy per run of adjacent blocks
    direct            kernel ⇄ pinned host blocks (PCIe inside the kernel)

Whole transfers stage chunk by chunk, in a few groups of chunks, so the kernel of one group
runs while another group crosses PCIe (a store not waited for: one group, its copies paced);
layerwise ones stage layer by layer (layer l of every chunk side by side), so each layer
crosses PCIe in one copy per run and has its own kernel:

    chunk-major  | c0: L0 L1 .. | c1: L0 L1 .. |       (store, retrieve)
    layer-major  | L0: c0 c1 .. | L1: c0 c1 .. |       (layerwise)

A load's copies into staging can be queued before its slots are known (`upload`, at the
scheduler's lookup); its `scatter` then queues only the kernels, and reads the slot table
from pinned memory in a kernel of its own (a copy-engine copy would wait behind the chunks).

In staging, chunks sit in the order of their host addresses (within a group), so blocks that
are neighbours in the pool are neighbours there too, whatever tokens they hold: a run of
them is one strided copy.

Uploads into staging go by a kernel (host_runs_kernel) or the copy engine: `upload` kernel |
copy_engine | auto (kernel for layer-major ones). The copy engine serves host-to-device
copies in queue order from every stream, so vLLM's next-step inputs wait behind a bulk
upload (staging.py).

Kernels run on one side stream and PCIe copies on two others (one a direction: a load's copies
up run beside a store's copies down), ordered by events; all are ordered
after the caller's stream, and the caller's stream waits for them (for a gather not waited for, for
its kernels only); a load beside the steps runs its kernels on its own stream. Direct needs every
chunk pinned; a call with a pageable chunk is staged. Figures: results/README.md. With a lossy
codec (quant.py) the kernels quantize as they gather and dequantize as they scatter: staging,
copies and host chunks hold the quantized bytes. Correctness is also checked on CPU with
TRITON_INTERPRET=1.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import triton

from kvtier.transfer import base, cudart
from kvtier.transfer.addressed import AddressedGather
from kvtier.transfer.base import InFlight, LayerHandle
from kvtier.transfer.kernels import (
    SLOT_BLOCK,
    host_words_kernel,
    kv_copy_kernel,
    kv_int4_copy_kernel,
    kv_quant_copy_kernel,
)
from kvtier.transfer.layout import PagedKV
from kvtier.transfer.pacing import PIECE_BYTES, PacedCopies
from kvtier.transfer.quant import Quant
from kvtier.transfer.staging import (
    DigestTables,
    LayerEvents,
    Run,
    Staging,
    Summing,
    Upload,
    copy_runs,
    host_tables,
    run_table,
    summing,
    waiter,
)

GROUPS = 4  # whole transfers: kernel of group g+1 runs while group g crosses PCIe
DIGEST_LAYERS = 8  # layers summed per digest launch of a layerwise scatter


def _launch(kv: PagedKV, quant: Quant | None) -> tuple[Any, dict[str, Any]]:
    """The copy kernel of `quant` (None: lossless) and its constants for this KV cache."""
    if quant is None:
        w = kv.heads * kv.head_size
        return kv_copy_kernel, {"W": w, "D": kv.head_size, "BLOCK": min(_pow2(w), 4096)}
    shape = {"NH": kv.heads, "D": kv.head_size, "NHP": _pow2(kv.heads)}
    if quant.name == "int4":
        groups = {"G": quant.group, "NG": quant.groups, "NGP": _pow2(quant.groups)}
        return kv_int4_copy_kernel, {**shape, **groups, "ROW": quant.row_bytes}
    scales = {"DP": _pow2(kv.head_size), "FP8": quant.name == "fp8", "QMAX": quant.qmax}
    return kv_quant_copy_kernel, {**shape, **scales}


def _pow2(n: int) -> int:
    return int(triton.next_power_of_2(n))


class TritonTransfer:
    """Triton gather/scatter; `direct` kernels touch pinned host chunks."""

    name = "triton"

    def __init__(
        self,
        kv: PagedKV,
        *,
        direct: bool = False,
        quant: Quant | None = None,
        upload: str = "auto",
        store_piece: int = PIECE_BYTES,
    ) -> None:
        self.kv = kv
        self.direct = direct
        self.upload_mode = upload
        self.quant = quant
        layers = kv.joined()
        self._strides = layers[0].stride()[:4]
        self._layer_ptrs = torch.tensor(
            [t.data_ptr() for t in layers], dtype=torch.int64, device=kv.device
        )
        # each layer's row of a [G, T] slot table (PagedKV.grouped; all 0 for one group)
        self._slot_rows = torch.tensor(
            kv.slot_rows or [0] * kv.num_layers, dtype=torch.int32, device=kv.device
        )
        # Per-layer launches pass one of these; slicing anew per launch is host time
        # in front of a forward pass that is itself host-bound.
        self._one_layer = [
            (self._layer_ptrs[i : i + 1], self._slot_rows[i : i + 1]) for i in range(kv.num_layers)
        ]
        self._launch = _launch(kv, quant)
        on_cuda = kv.device.type == "cuda"
        # None in Triton's interpreter (no device): nothing is staged there.
        self._stream = torch.cuda.Stream(kv.device) if on_cuda else None  # kernels
        self._copies = torch.cuda.Stream(kv.device) if on_cuda else None  # PCIe copies down
        # and up: two streams, so that a load's copies up run beside a store's copies down (the
        # two directions of the link at once), ordered by events where one reads the other's
        self._copies_up = torch.cuda.Stream(kv.device) if on_cuda else None
        # the copies down of gathers not waited for, one piece at a time (pacing.py)
        self._paced = PacedCopies(self._copies, store_piece) if self._copies is not None else None
        if on_cuda and not cudart.available():
            raise RuntimeError(
                "the Triton transfer needs cudaMemcpy2DAsync from the CUDA runtime torch loaded, "
                "and found no libcudart in this process; use transfer='torch'"
            )

    @property
    def _kernel_stream(self) -> torch.cuda.Stream:
        """The kernels' side stream, which staged transfers use (a KV cache on a GPU)."""
        if self._stream is None:
            raise RuntimeError("the Triton interpreter has no streams: nothing is staged there")
        return self._stream

    @property
    def _copy_stream(self) -> torch.cuda.Stream:
        """The stream of the PCIe copies to the host, which staged transfers use (a KV cache on a
        GPU)."""
        if self._copies is None:
            raise RuntimeError("the Triton interpreter has no streams: nothing is staged there")
        return self._copies

    @property
    def _paced_copies(self) -> PacedCopies:
        """The copies down of gathers not waited for (a KV cache on a GPU)."""
        if self._paced is None:
            raise RuntimeError("the Triton interpreter has no streams: nothing is staged there")
        return self._paced

    @property
    def _upload_stream(self) -> torch.cuda.Stream:
        """The stream of the PCIe copies to the device (staged loads)."""
        if self._copies_up is None:
            raise RuntimeError("the Triton interpreter has no streams: nothing is staged there")
        return self._copies_up

    # -- building blocks -----------------------------------------------------------

    def _upload(self, slots: torch.Tensor, ptrs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Device copies of the slot and address tables. On a GPU they go up
        from pinned memory: an upload from pageable memory would make the
        host wait for everything queued on the stream before it."""
        slots = slots.to(torch.int64).contiguous()  # [G, T]: a slice of a wider table is not
        if self.kv.device.type == "cuda":
            slots, ptrs = slots.pin_memory(), ptrs.pin_memory()
        return slots.to(self.kv.device, non_blocking=True), ptrs.to(
            self.kv.device, non_blocking=True
        )

    def _kernel(
        self,
        slots: torch.Tensor,
        ptrs: torch.Tensor,
        chunk_size: int,
        to_chunk: bool,
        layers: range,
    ) -> None:
        """One launch over `layers`; ptrs[c] is where chunk c's first layer of `layers` is.
        `slots`: [T], or [G, T] for grouped KV (any row stride: a slice of a wider table)."""
        kv = self.kv
        total = slots.shape[-1]
        row_stride = slots.stride(0) if slots.dim() == 2 else 0
        s_k, s_b, s_n, s_h = self._strides
        grid = (total, len(layers) * kv.kv)
        tables, rows = (
            self._one_layer[layers.start]
            if len(layers) == 1
            else (
                self._layer_ptrs[layers.start : layers.stop],
                self._slot_rows[layers.start : layers.stop],
            )
        )
        kernel, consts = self._launch
        kernel[grid](
            kv.layers[0],
            tables,
            rows,
            ptrs,
            slots,
            row_stride,
            total,
            chunk_size,
            s_k,
            s_b,
            s_n,
            s_h,
            kv.block_size,
            K=kv.kv,
            TO_CHUNK=to_chunk,
            GROUPED=slots.dim() == 2,
            **consts,
        )

    def _host_ptrs(self, chunks: Sequence[torch.Tensor], layers: range) -> torch.Tensor:
        starts = torch.tensor([c.data_ptr() for c in chunks], dtype=torch.int64)
        layer_bytes = torch.tensor(
            [c[0].numel() * c.element_size() for c in chunks], dtype=torch.int64
        )
        return (
            starts[None, :]
            + torch.arange(layers.start, layers.stop)[:, None] * layer_bytes[None, :]
        )

    def _digest_tables(self, tables: torch.Tensor) -> DigestTables:
        return DigestTables(tables, self.kv.device, upload=self._stream is not None)

    def _staged(self, chunks: Sequence[torch.Tensor]) -> bool:
        """Chunks in host memory that the kernel should not touch across PCIe."""
        if self._stream is None or chunks[0].is_cuda:
            return False
        return not (self.direct and all(c.is_pinned() for c in chunks))

    def _layerwise_tables(
        self, slots: torch.Tensor, chunks: Sequence[torch.Tensor]
    ) -> tuple[Staging | None, torch.Tensor, torch.Tensor]:
        """Layer-major staging (None where the kernel reaches the chunks itself)
        and the device slot table and [layer, chunk] address table; on the
        current stream."""
        layers = range(self.kv.num_layers)
        staging = (
            Staging(chunks, self.kv.device, layer_major=True) if self._staged(chunks) else None
        )
        dev_slots, ptrs = self._upload(
            slots, staging.ptrs(layers) if staging else self._host_ptrs(chunks, layers)
        )
        return staging, dev_slots, ptrs

    def _in_place(
        self,
        slots: torch.Tensor,
        chunks: Sequence[torch.Tensor],
        to_chunk: bool,
        layers: range,
        digests: torch.Tensor | None = None,
    ) -> None:
        """Chunks the kernel reaches itself (device memory, the interpreter, pinned with `direct`):
        one launch on the current stream (and the digests of the chunks, whole)."""
        dev_slots, ptrs = self._upload(
            slots, self._host_ptrs(chunks, range(layers.start, layers.start + 1))
        )
        sums = (
            Summing(self._digest_tables(host_tables(chunks, by_layer=False)), digests)
            if digests is not None
            else None
        )
        if sums is not None and not to_chunk:
            sums.add()
        self._kernel(dev_slots, ptrs[0], chunks[0].shape[2], to_chunk, layers)
        if sums is not None and to_chunk:
            sums.add()

    # -- whole transfers -------------------------------------------------------------

    def gather(
        self,
        slots: torch.Tensor,
        chunks: Sequence[torch.Tensor],
        digests: torch.Tensor | None = None,
        wait: bool = True,
    ) -> InFlight | None:
        """Fill `chunks` with the KV of `slots` (base.Transfer.gather): waited for, a kernel per
        group of chunks, each group's copy to the host behind it; not waited for, one kernel and
        its copies paced (pacing.py). `digests` (int64 zeros on the device, one per chunk):
        their KV digests are added there."""
        layers = range(self.kv.num_layers)
        if not self._staged(chunks):
            self._unstaged(lambda: self._in_place(slots, chunks, True, layers, digests), chunks)
            return None
        current = torch.cuda.current_stream(self.kv.device)
        stream, copies = self._kernel_stream, self._copy_stream
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            # Not waited for: one group, so one kernel and one digest launch (each is host time
            # on the engine's thread); its first copy then waits for a kernel over all its
            # chunks, not over a quarter of them: microseconds against a piece's 0.6 ms.
            groups = GROUPS if wait else 1
            staging = Staging(chunks, self.kv.device, layer_major=False, groups=groups)
            dev_slots, ptrs = self._upload(slots, staging.ptrs(range(1))[0])
            sums = (
                Summing(self._digest_tables(staging.digest_tables(by_layer=False)), digests)
                if digests is not None
                else None
            )
            size = chunks[0].shape[2]
            runs: list[tuple[Run, torch.cuda.Event]] = []  # not waited for: copied by the pacer
            for g, group in enumerate(staging.groups):
                a, b = group.start * size, min(group.stop * size, slots.shape[-1])
                self._kernel(
                    dev_slots[..., a:b], ptrs[group.start : group.stop], size, True, layers
                )
                if sums is not None:
                    sums.add(chunks=group)
                if wait:
                    copies.wait_stream(stream)
                    staging.copy(to_host=True, stream=copies, group=g)
                else:
                    kernel_done = stream.record_event()
                    runs += [(run, kernel_done) for run in staging.run_table(None, g)]
        if wait:
            copies.synchronize()
            return None
        current.wait_stream(stream)  # the kernels read the pages before anything later writes them
        return self._paced_copies.add(runs, keep=(staging, dev_slots, ptrs, sums))

    def gather_addressed(
        self, slots: torch.Tensor, addresses: Sequence[int], chunk_tokens: int
    ) -> AddressedGather:
        """Both tables go up now, on the current stream; each `launch` is one kernel."""
        dev_slots, ptrs = self._upload(slots, torch.tensor(addresses, dtype=torch.int64))
        layers = range(self.kv.num_layers)
        return AddressedGather(
            lambda s, p: self._kernel(s, p, chunk_tokens, True, layers),
            dev_slots,
            ptrs,
            chunk_tokens,
        )

    def upload(
        self,
        chunks: Sequence[torch.Tensor],
        layer_major: bool = False,
        digests: bool = False,
        beside: bool = False,
        ready: Sequence[torch.cuda.Event | None] = (),
    ) -> Upload | None:
        """Queue the copies of host chunks into device staging now (Transfer.upload), in groups
        or layer by layer; None where the kernels read them in place. Not after the caller's
        stream (staging is this transfer's). By kernel with gpu_upload `kernel`, or `auto` where
        they overlap forwards (layer-major, `beside`): the copy engine stays free for theirs.
        `ready`: each group (every layer: all) waits for its chunks' events first."""
        if not self._staged(chunks):
            return None
        return self._staged_upload(chunks, layer_major, digests, beside, ready)

    def _staged_upload(
        self,
        chunks: Sequence[torch.Tensor],
        layer_major: bool,
        digests: bool,
        beside: bool,
        ready: Sequence[torch.cuda.Event | None] = (),
    ) -> Upload:
        """`upload` of chunks that are staged (`_staged`)."""
        stream, copies = self._kernel_stream, self._upload_stream
        # the caller may be a thread whose current device is another
        with torch.cuda.device(self.kv.device):
            copies.wait_stream(stream)  # staging memory may still be read by earlier kernels
            with torch.cuda.stream(stream):
                staging = Staging(
                    chunks,
                    self.kv.device,
                    layer_major=layer_major,
                    groups=1 if layer_major else GROUPS,
                )
                # The tables go up first: the copy engine takes host-to-device copies in the
                # order they are queued, so tables queued behind the chunks would hold every
                # kernel until all chunks had crossed (the slots: _slots_up).
                layers = range(self.kv.num_layers)
                table = staging.ptrs(layers) if layer_major else staging.ptrs(range(1))[0]
                ptrs = table.pin_memory().to(self.kv.device, non_blocking=True)
                sums = (
                    self._digest_tables(staging.digest_tables(by_layer=layer_major))
                    if digests
                    else None
                )
                # What each part (a layer of every chunk, or a group of whole chunks) moves.
                parts = (
                    [{"layer": layer} for layer in layers]
                    if layer_major
                    else [{"group": g} for g in range(len(staging.groups))]
                )
                by_kernel = self.upload_mode == "kernel" or (
                    self.upload_mode == "auto" and (layer_major or beside)
                )
                runs = (
                    run_table([staging.run_table(**part) for part in parts]) if by_kernel else None
                )
                landed = []
                for k, part in enumerate(parts):
                    for event in _waits(ready, staging, k, layer_major):
                        copies.wait_event(event)
                    if runs is not None:
                        with torch.cuda.stream(copies):
                            copy_runs(*runs[k])
                    else:
                        staging.copy(to_host=False, stream=copies, **part)
                    landed.append(torch.cuda.Event())
                    landed[-1].record(copies)
        return Upload(staging, ptrs, sums, landed, layer_major, keep=runs)

    def _slots_up(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The slot table on the device, on the current stream, read from pinned memory by a
        kernel (an Upload's chunks may be crossing on the copy engine); and the pinned
        table, to keep until that kernel has run."""
        host = slots.to(torch.int64).contiguous().pin_memory()
        dev = torch.empty(host.shape, dtype=torch.int64, device=self.kv.device)
        if host.numel():
            host_words_kernel[(triton.cdiv(host.numel(), SLOT_BLOCK),)](
                host.data_ptr(), dev, host.numel(), BLOCK=SLOT_BLOCK
            )
        return dev, host

    def scatter(
        self,
        slots: torch.Tensor,
        chunks: Sequence[torch.Tensor],
        layers: range | None = None,
        wait: bool = True,
        digests: torch.Tensor | None = None,
        upload: base.Upload | None = None,
        beside: bool = False,
    ) -> Callable[[], None]:
        """Write `chunks` into the KV pages; the current stream is ordered after it.

        `layers` (device-resident or interpreter chunks only) limits the write to those layers.
        `digests` (int64 zeros on the device, one per chunk): the KV digests of the
        bytes as they arrived are added there (readable on the current stream).
        `upload`: these chunks' `upload()`, queued earlier (then only the kernels are queued).
        `beside` (Transfer.scatter): the kernels run on the current stream, after the upload there.
        Returns what waits for the copies out of the host chunks (done already with `wait`)."""
        layers = layers or range(self.kv.num_layers)
        if not self._staged(chunks):
            return self._unstaged(
                lambda: self._in_place(slots, chunks, False, layers, digests), chunks, wait
            )
        if len(layers) != self.kv.num_layers:
            raise ValueError("a layer range is for device-resident chunks; use scatter_layerwise")
        staged = _own(upload)
        if staged is None:
            staged = self._staged_upload(chunks, False, digests is not None, beside)
        elif staged.layer_major:
            raise ValueError("a layer-major upload is for scatter_layerwise")
        sums = summing(staged.sums, digests)
        current = torch.cuda.current_stream(self.kv.device)
        stream = current if beside else self._kernel_stream
        stream.wait_stream(current)  # (nothing to wait for where they are one: beside)
        with torch.cuda.stream(stream):
            dev_slots, host_slots = self._slots_up(slots)
            size = chunks[0].shape[2]
            for group, event in zip(staged.staging.groups, staged.landed):
                stream.wait_event(event)
                if sums is not None:
                    sums.add(chunks=group)
                a, b = group.start * size, min(group.stop * size, slots.shape[-1])
                self._kernel(
                    dev_slots[..., a:b], staged.ptrs[group.start : group.stop], size, False, layers
                )
        current.wait_stream(stream)
        # The caller releases the host blocks once the copies out of them are done (the kernels
        # waited for them); staging and the pinned slot table live until then.
        return waiter(stream, wait, keep=(staged, host_slots))

    def _unstaged(
        self, work, chunks: Sequence[torch.Tensor], wait: bool = True
    ) -> Callable[[], None]:
        """Device chunks (and the interpreter's): on the current stream.
        `direct` host chunks: on the side stream, waited for (now or by the
        returned function), since the caller frees or reads the chunks next."""
        if self._stream is None or chunks[0].is_cuda:
            work()
            return waiter(None, True)
        current = torch.cuda.current_stream(self.kv.device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            work()
        current.wait_stream(self._stream)
        return waiter(self._stream, wait)

    # -- layer by layer ------------------------------------------------------------------

    def scatter_layerwise(
        self,
        slots: torch.Tensor,
        chunks: Sequence[torch.Tensor],
        digests: torch.Tensor | None = None,
        upload: base.Upload | None = None,
    ) -> LayerHandle:
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
        staged = _own(upload)
        if staged is None:
            staged = self.upload(chunks, layer_major=True, digests=digests is not None)
        elif not staged.layer_major:
            raise ValueError("a chunk-major upload is for scatter")
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.kv.device))
        layers = range(self.kv.num_layers)
        events: list[torch.cuda.Event] = []
        keep = None
        with torch.cuda.stream(stream):
            if staged is not None:
                dev_slots, keep = self._slots_up(slots)
                ptrs, sums = staged.ptrs, summing(staged.sums, digests)
            else:  # the kernels read the chunks where they are
                _, dev_slots, ptrs = self._layerwise_tables(slots, chunks)
                sums = (
                    None
                    if digests is None
                    else Summing(self._digest_tables(host_tables(chunks, by_layer=True)), digests)
                )
            summed = 0  # layers whose digests are queued
            for layer, row in zip(layers, ptrs.unbind(0)):
                if staged is not None:
                    stream.wait_event(staged.landed[layer])
                self._kernel(dev_slots, row, chunks[0].shape[2], False, range(layer, layer + 1))
                events.append(torch.cuda.Event())
                events[-1].record(stream)
                if sums is not None and (
                    layer + 1 - summed == DIGEST_LAYERS or layer >= layers[-1] - 1
                ):
                    # Behind the layer's event, so that no forward waits for it; several layers per
                    # launch (each launch is host time in front of the forward), the last one alone
                    # (what runs after the last layer lands, `finish()` waits for).
                    sums.add(rows=range(summed, layer + 1))
                    summed = layer + 1
        return LayerEvents(events, stream, self._upload_stream, (staged, keep))

    def gather_layerwise(
        self,
        slots: torch.Tensor,
        chunks: Sequence[torch.Tensor],
        digests: torch.Tensor | None = None,
    ) -> LayerSaves:
        """A gather the caller drives layer by layer: `save(l)` once layer l's
        KV is written (on the current stream) queues its gather and copy to
        the host behind it; `finish()` returns once the saved layers have landed.
        `digests`: as in `gather`, complete (if every layer was saved) after `finish()`."""
        return LayerSaves(self, slots, chunks, digests)


class LayerSaves:
    """A layerwise gather: layer l moves when `save(l)` says it is computed."""

    def __init__(
        self,
        transfer: TritonTransfer,
        slots: torch.Tensor,
        chunks: Sequence[torch.Tensor],
        digests: torch.Tensor | None = None,
    ) -> None:
        self._t, self._chunks = transfer, list(chunks)
        self._sums: Summing | None = None
        self._saved = [False] * transfer.kv.num_layers
        self._stream = transfer._stream
        # The interpreter has no stream: its kernels write the host chunks directly.
        with (
            torch.cuda.stream(self._stream)
            if self._stream is not None
            else contextlib.nullcontext()
        ):
            self._staging, self._slots, self._ptrs = transfer._layerwise_tables(slots, chunks)
            if digests is not None:
                tables = transfer._digest_tables(
                    self._staging.digest_tables(by_layer=True)
                    if self._staging
                    else host_tables(self._chunks, by_layer=True)
                )
                self._sums = Summing(tables, digests)

    def save(self, layer: int) -> None:
        if self._saved[layer]:
            return
        self._saved[layer] = True
        t, n_c = self._t, self._chunks[0].shape[2]
        if self._stream is None:
            t._kernel(self._slots, self._ptrs[layer], n_c, True, range(layer, layer + 1))
            if self._sums is not None:
                self._sums.add(rows=range(layer, layer + 1))
            return
        self._stream.wait_stream(torch.cuda.current_stream(t.kv.device))
        with torch.cuda.stream(self._stream):
            t._kernel(self._slots, self._ptrs[layer], n_c, True, range(layer, layer + 1))
            if self._sums is not None:
                self._sums.add(rows=range(layer, layer + 1))
        if self._staging:
            t._copy_stream.wait_stream(self._stream)
            self._staging.copy(to_host=True, stream=t._copy_stream, layer=layer)

    def finish(self) -> None:
        """Every saved layer in the host chunks."""
        if (flight := self.finish_later()) is not None:
            flight.done.synchronize()

    def finish_later(self) -> InFlight | None:
        if self._stream is None:
            return None
        # the gathers read the pages
        torch.cuda.current_stream(self._t.kv.device).wait_stream(self._stream)
        last = self._t._copy_stream if self._staging else self._stream
        last.wait_stream(self._stream)
        # this saver holds the staging the copies read
        return InFlight(last.record_event(), keep=self)

    def unsaved(self) -> list[int]:
        return [layer for layer, saved in enumerate(self._saved) if not saved]


def _waits(
    ready: Sequence[torch.cuda.Event | None], staging: Staging, part: int, layer_major: bool
) -> list[torch.cuda.Event]:
    """The events an upload's part waits for: those of its chunks (a layer holds every chunk:
    all before the first layer)."""
    if layer_major:
        chunks = range(len(ready)) if part == 0 else range(0)
    else:
        chunks = staging.groups[part]
    return list(dict.fromkeys(e for i in chunks if i < len(ready) and (e := ready[i]) is not None))


def _own(upload: base.Upload | None) -> Upload | None:
    """An upload given to a scatter: one this transfer queued (`TritonTransfer.upload`)."""
    if upload is None or isinstance(upload, Upload):
        return upload
    raise TypeError(f"the Triton transfer scatters its own uploads, not a {type(upload).__name__}")
