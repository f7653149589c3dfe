"""Gather/scatter between paged KV and chunk buffers with torch indexing.

The CPU path (vLLM's CPU backend keeps KV in host memory, so there is no
device copy), and the fallback where Triton is absent.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvtier.transfer.base import Upload
from kvtier.transfer.layout import PagedKV
from kvtier.transfer.quant import Quant


class TorchTransfer:
    name = "torch"

    def __init__(self, kv: PagedKV, quant: Quant | None = None) -> None:
        self.kv = kv
        self.quant = quant  # chunks hold quantized rows [L, K, T, R] (quant.py)

    def _index(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        slots = slots.to(self.kv.device, non_blocking=True)
        return slots // self.kv.block_size, slots % self.kv.block_size

    def _row(self, slots: torch.Tensor, layer: int) -> tuple[int, torch.Tensor]:
        """Layer `layer`'s slots and their row: `slots` itself (row 0), or its row of a
        grouped KV's [G, T] table."""
        if slots.dim() == 1:
            return 0, slots
        row = self.kv.slot_rows[layer]
        return row, slots[row]

    def gather(
        self,
        slots: torch.Tensor,
        chunks: Sequence[torch.Tensor],
        digests: torch.Tensor | None = None,
        wait: bool = True,
        *,
        layers: range | None = None,
    ) -> None:
        """Copy the KV of `slots` into `chunks` ([L, K, T_i, H, D], in order), all layers or
        `layers`, whatever `wait` says (nothing runs beside the caller).
        A token at slot -1 (grouped KV: a page its group no longer keeps) gets whatever
        slot 0 holds: nothing reads it back there. (KV digests are the Triton transfer's:
        `digests` must be None here.)"""
        _no_digests(digests)
        index = {}  # per row of a grouped KV's table
        for layer_idx in layers or range(self.kv.num_layers):
            r, row = self._row(slots, layer_idx)
            if r not in index:
                index[r] = self._index(row.clamp(min=0))
            block, offset = index[r]
            tokens = self.kv.read(layer_idx, block, offset)  # [K, T, H, D]
            start = 0
            for chunk in chunks:
                n = chunk.shape[2]
                if self.quant is not None:
                    self.quant.encode(tokens[:, start : start + n], chunk[layer_idx])
                else:
                    chunk[layer_idx].copy_(tokens[:, start : start + n], non_blocking=True)
                start += n
        # (the fallback where Triton is absent) the chunks are read next
        if self.kv.device.type == "cuda":
            torch.cuda.current_stream(self.kv.device).synchronize()

    def gather_addressed(
        self, slots: torch.Tensor, addresses: Sequence[int], chunk_tokens: int
    ) -> None:
        """Indexing takes tensors, not addresses: the caller gathers into views (`gather`)."""
        return None

    def upload(
        self,
        chunks: Sequence[torch.Tensor],
        layer_major: bool = False,
        digests: bool = False,
        beside: bool = False,
        ready: Sequence[torch.cuda.Event | None] = (),
    ) -> None:
        """Nothing to queue ahead: the copies happen in `scatter`."""
        return None

    def scatter(
        self,
        slots: torch.Tensor,
        chunks: Sequence[torch.Tensor],
        layers: range | None = None,
        wait: bool = True,
        digests: torch.Tensor | None = None,
        upload: Upload | None = None,
        beside: bool = False,
    ) -> Callable[[], None]:
        """Copy `chunks` back into the KV pages at `slots` (all layers, or `layers`); slot -1 is
        skipped. The copies are synchronous here, whatever `wait` and `beside` say."""
        _no_digests(digests)
        index = {}  # per row of a grouped KV's table
        for layer_idx in layers or range(self.kv.num_layers):
            r, row = self._row(slots, layer_idx)
            if r not in index:
                keep = None if bool((row >= 0).all()) else (row >= 0).nonzero().flatten()
                index[r] = (keep, self._index(row if keep is None else row[keep]))
            keep, (block, offset) = index[r]
            parts = [chunk[layer_idx] for chunk in chunks]
            tokens = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
            if keep is not None:
                tokens = tokens[:, keep.to(tokens.device)]
            if self.quant is not None:
                tokens = self.quant.decode(tokens, self.kv.dtype)
            self.kv.write(layer_idx, block, offset, tokens.to(self.kv.device, non_blocking=True))
        return _done

    def scatter_layerwise(
        self,
        slots: torch.Tensor,
        chunks: Sequence[torch.Tensor],
        digests: torch.Tensor | None = None,
        upload: Upload | None = None,
    ) -> LazyLayers:
        _no_digests(digests)
        return LazyLayers(self, slots, chunks)

    def gather_layerwise(
        self,
        slots: torch.Tensor,
        chunks: Sequence[torch.Tensor],
        digests: torch.Tensor | None = None,
    ) -> EagerSaves:
        _no_digests(digests)
        return EagerSaves(self, slots, chunks)


def _no_digests(digests: object) -> None:
    if digests is not None:
        raise ValueError(
            "KV digests are summed by the Triton transfer on a GPU, not by the torch one"
        )


def _done() -> None:
    """The copies are over already."""


class EagerSaves:
    """Layerwise gather with no device to overlap with: layer l is copied
    when `save(l)` is called."""

    def __init__(
        self, transfer: TorchTransfer, slots: torch.Tensor, chunks: Sequence[torch.Tensor]
    ) -> None:
        self._transfer, self._slots, self._chunks = transfer, slots, list(chunks)
        self._saved = [False] * transfer.kv.num_layers

    def save(self, layer: int) -> None:
        if not self._saved[layer]:
            self._saved[layer] = True
            self._transfer.gather(self._slots, self._chunks, layers=range(layer, layer + 1))

    def finish(self) -> None:
        self._chunks = []

    def finish_later(self) -> None:
        self.finish()  # each layer was copied when saved

    def unsaved(self) -> list[int]:
        return [layer for layer, saved in enumerate(self._saved) if not saved]


class LazyLayers:
    """Layerwise scatter without a device to overlap with: layer l is written
    when it is first waited for, so compute and loads still interleave in
    layer order (the Triton interpreter uses this too)."""

    def __init__(self, transfer, slots: torch.Tensor, chunks: Sequence[torch.Tensor]) -> None:
        self._transfer, self._slots, self._chunks = transfer, slots, list(chunks)
        self._done = 0

    def wait(self, layer: int) -> None:
        if layer >= self._done:
            self._transfer.scatter(self._slots, self._chunks, layers=range(self._done, layer + 1))
            self._done = layer + 1

    def finish(self) -> None:
        self.wait(self._transfer.kv.num_layers - 1)
        self._chunks = []
