"""Layer-by-layer Triton transfers: a load whose layer l the forward waits for alone
(`scatter_layerwise`), and a store whose layer l moves once the forward has written it
(`LayerSaves`). Both stage layer-major, so each layer crosses PCIe in one copy per run of
neighbouring blocks and has its own kernel (triton_copy.py draws the layouts):

    layer-major  | L0: c0 c1 .. | L1: c0 c1 .. |
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from kvtier.transfer.base import InFlight
from kvtier.transfer.staging import (
    LayerEvents,
    Staging,
    Summing,
    Upload,
    host_tables,
    summing,
)
from kvtier.transfer.triton_launch import Kernels, Streams

DIGEST_LAYERS = 8  # layers summed per digest launch of a layerwise scatter


def scatter_layerwise(
    kernels: Kernels,
    streams: Streams,
    slots: torch.Tensor,
    chunks: Sequence[torch.Tensor],
    staged: Upload | None,
    digests: torch.Tensor | None = None,
) -> LayerEvents:
    """Queue every layer's kernel at once on the kernel stream, layer l's behind its upload
    (`staged`, layer-major; None: the kernels read pinned chunks in place); the caller's stream
    waits only for the layer it is about to use. `digests`: as in TritonTransfer.scatter, layer
    by layer (complete once the handle's `finish()` returns)."""
    stream = streams.kernels
    stream.wait_stream(torch.cuda.current_stream(kernels.kv.device))
    layers = range(kernels.kv.num_layers)
    events: list[torch.cuda.Event] = []
    keep = None
    with torch.cuda.stream(stream):
        if staged is not None:
            dev_slots, keep = kernels.slots_up(slots)
            ptrs, sums = staged.ptrs, summing(staged.sums, digests)
        else:  # the kernels read the chunks where they are
            _, dev_slots, ptrs = layerwise_tables(kernels, slots, chunks, staged=False)
            sums = (
                None
                if digests is None
                else Summing(kernels.digest_tables(host_tables(chunks, by_layer=True)), digests)
            )
        summed = 0  # layers whose digests are queued
        for layer, row in zip(layers, ptrs.unbind(0)):
            if staged is not None:
                stream.wait_event(staged.landed[layer])
            kernels.launch(dev_slots, row, chunks[0].shape[2], False, range(layer, layer + 1))
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
    return LayerEvents(events, stream, streams.up, (staged, keep))


def layerwise_tables(
    kernels: Kernels, slots: torch.Tensor, chunks: Sequence[torch.Tensor], staged: bool
) -> tuple[Staging | None, torch.Tensor, torch.Tensor]:
    """Layer-major staging (None where the kernel reaches the chunks itself: not `staged`)
    and the device slot table and [layer, chunk] address table; on the current stream."""
    layers = range(kernels.kv.num_layers)
    staging = Staging(chunks, kernels.kv.device, layer_major=True) if staged else None
    dev_slots, ptrs = kernels.tables_up(
        slots, staging.ptrs(layers) if staging else kernels.host_ptrs(chunks, layers)
    )
    return staging, dev_slots, ptrs


class LayerSaves:
    """A layerwise gather: layer l moves when `save(l)` says it is computed. `streams` None:
    the interpreter, whose kernels write the host chunks directly; `staged`: through device
    staging, each layer copied down on the copy stream behind its kernel."""

    def __init__(
        self,
        kernels: Kernels,
        streams: Streams | None,
        slots: torch.Tensor,
        chunks: Sequence[torch.Tensor],
        staged: bool,
        digests: torch.Tensor | None = None,
    ) -> None:
        self._kernels, self._streams, self._chunks = kernels, streams, list(chunks)
        self._sums: Summing | None = None
        self._saved = [False] * kernels.kv.num_layers
        with (
            torch.cuda.stream(streams.kernels) if streams is not None else contextlib.nullcontext()
        ):
            self._staging, self._slots, self._ptrs = layerwise_tables(
                kernels, slots, chunks, staged
            )
            if digests is not None:
                tables = kernels.digest_tables(
                    self._staging.digest_tables(by_layer=True)
                    if self._staging
                    else host_tables(self._chunks, by_layer=True)
                )
                self._sums = Summing(tables, digests)

    def save(self, layer: int) -> None:
        """Queue layer `layer`'s gather (and its copy down) behind the caller's stream."""
        if self._saved[layer]:
            return
        self._saved[layer] = True
        streams = self._streams
        if streams is None:
            self._gather(layer)
            return
        streams.kernels.wait_stream(torch.cuda.current_stream(self._kernels.kv.device))
        with torch.cuda.stream(streams.kernels):
            self._gather(layer)
        if self._staging:
            streams.down.wait_stream(streams.kernels)
            self._staging.copy(to_host=True, stream=streams.down, layer=layer)

    def _gather(self, layer: int) -> None:
        n_c = self._chunks[0].shape[2]
        self._kernels.launch(self._slots, self._ptrs[layer], n_c, True, range(layer, layer + 1))
        if self._sums is not None:
            self._sums.add(rows=range(layer, layer + 1))

    def finish(self) -> None:
        """Every saved layer in the host chunks."""
        if (flight := self.finish_later()) is not None:
            flight.done.synchronize()

    def finish_later(self) -> InFlight | None:
        streams = self._streams
        if streams is None:
            return None
        # the gathers read the pages
        torch.cuda.current_stream(self._kernels.kv.device).wait_stream(streams.kernels)
        last = streams.down if self._staging else streams.kernels
        last.wait_stream(streams.kernels)
        # this saver holds the staging the copies read
        return InFlight(last.record_event(), keep=self)

    def unsaved(self) -> list[int]:
        return [layer for layer, saved in enumerate(self._saved) if not saved]
