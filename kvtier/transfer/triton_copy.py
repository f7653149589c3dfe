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
TRITON_INTERPRET=1. The kernel's launch and the streams: triton_launch.py; layer by layer:
triton_layerwise.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvtier.transfer import base, cudart
from kvtier.transfer.addressed import AddressedGather
from kvtier.transfer.base import InFlight, LayerHandle
from kvtier.transfer.layout import PagedKV
from kvtier.transfer.pacing import PIECE_BYTES
from kvtier.transfer.quant import Quant
from kvtier.transfer.staging import (
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
from kvtier.transfer.triton_launch import Kernels, Streams
from kvtier.transfer.triton_layerwise import LayerSaves, scatter_layerwise

GROUPS = 4  # whole transfers: kernel of group g+1 runs while group g crosses PCIe


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
        self._kernels = Kernels(kv, quant)
        on_cuda = kv.device.type == "cuda"
        # None in Triton's interpreter (no device): nothing is staged there.
        self._streams = Streams(kv.device, store_piece) if on_cuda else None
        if on_cuda and not cudart.available():
            raise RuntimeError(
                "the Triton transfer needs cudaMemcpy2DAsync from the CUDA runtime torch loaded, "
                "and found no libcudart in this process; use transfer='torch'"
            )

    @property
    def streams(self) -> Streams:
        """The side streams, which staged transfers use (a KV cache on a GPU)."""
        if self._streams is None:
            raise RuntimeError("the Triton interpreter has no streams: nothing is staged there")
        return self._streams

    def _staged(self, chunks: Sequence[torch.Tensor]) -> bool:
        """Chunks in host memory that the kernel should not touch across PCIe."""
        if self._streams is None or chunks[0].is_cuda:
            return False
        return not (self.direct and all(c.is_pinned() for c in chunks))

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
        kernels = self._kernels
        dev_slots, ptrs = kernels.tables_up(
            slots, kernels.host_ptrs(chunks, range(layers.start, layers.start + 1))
        )
        sums = (
            Summing(kernels.digest_tables(host_tables(chunks, by_layer=False)), digests)
            if digests is not None
            else None
        )
        if sums is not None and not to_chunk:
            sums.add()
        kernels.launch(dev_slots, ptrs[0], chunks[0].shape[2], to_chunk, layers)
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
        kernels, streams = self._kernels, self.streams
        stream, copies = streams.kernels, streams.down
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            # Not waited for: one group, so one kernel and one digest launch (each is host time
            # on the engine's thread); its first copy then waits for a kernel over all its
            # chunks, not over a quarter of them: microseconds against a piece's 0.6 ms.
            groups = GROUPS if wait else 1
            staging = Staging(chunks, self.kv.device, layer_major=False, groups=groups)
            dev_slots, ptrs = kernels.tables_up(slots, staging.ptrs(range(1))[0])
            sums = (
                Summing(kernels.digest_tables(staging.digest_tables(by_layer=False)), digests)
                if digests is not None
                else None
            )
            size = chunks[0].shape[2]
            runs: list[tuple[Run, torch.cuda.Event]] = []  # not waited for: copied by the pacer
            for g, group in enumerate(staging.groups):
                a, b = group.start * size, min(group.stop * size, slots.shape[-1])
                kernels.launch(
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
        return streams.paced.add(runs, keep=(staging, dev_slots, ptrs, sums))

    def gather_addressed(
        self, slots: torch.Tensor, addresses: Sequence[int], chunk_tokens: int
    ) -> AddressedGather:
        """Both tables go up now, on the current stream; each `launch` is one kernel."""
        kernels = self._kernels
        dev_slots, ptrs = kernels.tables_up(slots, torch.tensor(addresses, dtype=torch.int64))
        layers = range(self.kv.num_layers)
        return AddressedGather(
            lambda s, p: kernels.launch(s, p, chunk_tokens, True, layers),
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
        stream, copies = self.streams.kernels, self.streams.up
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
                # kernel until all chunks had crossed (the slots: Kernels.slots_up).
                layers = range(self.kv.num_layers)
                table = staging.ptrs(layers) if layer_major else staging.ptrs(range(1))[0]
                ptrs = table.pin_memory().to(self.kv.device, non_blocking=True)
                sums = (
                    self._kernels.digest_tables(staging.digest_tables(by_layer=layer_major))
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
        stream = current if beside else self.streams.kernels
        stream.wait_stream(current)  # (nothing to wait for where they are one: beside)
        with torch.cuda.stream(stream):
            dev_slots, host_slots = self._kernels.slots_up(slots)
            size = chunks[0].shape[2]
            for group, event in zip(staged.staging.groups, staged.landed):
                stream.wait_event(event)
                if sums is not None:
                    sums.add(chunks=group)
                a, b = group.start * size, min(group.stop * size, slots.shape[-1])
                self._kernels.launch(
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
        if self._streams is None or chunks[0].is_cuda:
            work()
            return waiter(None, True)
        stream = self._streams.kernels
        current = torch.cuda.current_stream(self.kv.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            work()
        current.wait_stream(stream)
        return waiter(stream, wait)

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
        if self._streams is None:
            if digests is not None:
                raise ValueError("digests are computed on a CUDA device")
            from kvtier.transfer.torch_copy import LazyLayers

            return LazyLayers(self, slots, chunks)
        staged = _own(upload)
        if staged is None:
            staged = self.upload(chunks, layer_major=True, digests=digests is not None)
        elif not staged.layer_major:
            raise ValueError("a chunk-major upload is for scatter")
        return scatter_layerwise(self._kernels, self._streams, slots, chunks, staged, digests)

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
        staged = self._staged(chunks)
        return LayerSaves(self._kernels, self._streams, slots, chunks, staged, digests)


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
