"""What every Triton transfer launches with: the copy kernel of one paged KV cache with its
constants and tables (`Kernels`), and the side streams its staged work runs on (`Streams`).

A launch moves the H*D values of each (token, layer, K-or-V) between the engine's KV page and a
chunk (kernels.py); it finds layers and chunks through tables of base addresses, so both
whole transfers (triton_copy.py) and layer-by-layer ones (triton_layerwise.py) use one kernel.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import triton

from kvtier.transfer.kernels import (
    SLOT_BLOCK,
    host_words_kernel,
    kv_copy_kernel,
    kv_int4_copy_kernel,
    kv_quant_copy_kernel,
)
from kvtier.transfer.layout import PagedKV
from kvtier.transfer.pacing import PacedCopies
from kvtier.transfer.quant import Quant
from kvtier.transfer.staging import DigestTables


class Kernels:
    """The copy kernel of `kv` for `quant` (None: lossless), launched over a range of layers."""

    def __init__(self, kv: PagedKV, quant: Quant | None) -> None:
        self.kv = kv
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

    def launch(
        self,
        slots: torch.Tensor,
        ptrs: torch.Tensor,
        chunk_size: int,
        to_chunk: bool,
        layers: range,
    ) -> None:
        """One launch over `layers`, on the current stream; ptrs[c] is where chunk c's first layer
        of `layers` is. `slots`: [T], or [G, T] for grouped KV (any row stride: a slice of a wider
        table)."""
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

    def tables_up(
        self, slots: torch.Tensor, ptrs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Device copies of the slot and address tables. On a GPU they go up
        from pinned memory: an upload from pageable memory would make the
        host wait for everything queued on the stream before it."""
        slots = slots.to(torch.int64).contiguous()  # [G, T]: a slice of a wider table is not
        if self.kv.device.type == "cuda":
            slots, ptrs = slots.pin_memory(), ptrs.pin_memory()
        return slots.to(self.kv.device, non_blocking=True), ptrs.to(
            self.kv.device, non_blocking=True
        )

    def slots_up(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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

    def host_ptrs(self, chunks: Sequence[torch.Tensor], layers: range) -> torch.Tensor:
        """[layer, chunk] addresses of `layers` in the chunks themselves (kernels reach them)."""
        starts = torch.tensor([c.data_ptr() for c in chunks], dtype=torch.int64)
        layer_bytes = torch.tensor(
            [c[0].numel() * c.element_size() for c in chunks], dtype=torch.int64
        )
        return (
            starts[None, :]
            + torch.arange(layers.start, layers.stop)[:, None] * layer_bytes[None, :]
        )

    def digest_tables(self, tables: torch.Tensor) -> DigestTables:
        return DigestTables(tables, self.kv.device, upload=self.kv.device.type == "cuda")


class Streams:
    """The side streams of staged transfers on one GPU (the interpreter has none): kernels on one,
    PCIe copies on two others, one a direction, so that a load's copies up run beside a store's
    copies down (the two directions of the link at once), ordered by events where one reads the
    other's. The copies down of gathers not waited for go one piece at a time (pacing.py)."""

    def __init__(self, device: torch.device, store_piece: int) -> None:
        self.kernels = torch.cuda.Stream(device)
        self.down = torch.cuda.Stream(device)
        self.up = torch.cuda.Stream(device)
        self.paced = PacedCopies(self.down, store_piece)


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
