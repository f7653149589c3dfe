"""The transfer for a KV cache: Triton kernels on a GPU, torch indexing on the host."""

from __future__ import annotations

import os

import torch

from kvtier.transfer.base import Transfer
from kvtier.transfer.layout import PagedKV
from kvtier.transfer.pacing import PIECE_BYTES
from kvtier.transfer.quant import Quant


def make_transfer(
    kv: PagedKV,
    backend: str = "auto",
    quant: Quant | None = None,
    upload: str = "auto",
    store_piece: int = PIECE_BYTES,
) -> Transfer:
    """Triton kernels for GPU caches, torch indexing for host caches; with `quant`,
    chunks hold that codec's quantized rows (quant.py). `upload`: how staged loads
    cross PCIe, kernel | copy_engine | auto (triton_copy.py). `store_piece`: bytes of the
    copies down of a store not waited for queued at a time (pacing.py; 0: all at once)."""
    if backend == "auto":
        backend = "triton" if kv.device.type == "cuda" and not kv.split else "torch"
    if (
        quant is not None
        and quant.name == "fp8"
        and kv.device.type == "cuda"
        and torch.cuda.get_device_capability(kv.device) < (8, 9)
    ):
        raise ValueError(
            f"the fp8 KV codec needs a GPU with fp8 (compute capability 8.9+), {kv.device} is "
            f"{torch.cuda.get_device_name(kv.device)}: use int8"
        )
    if backend == "torch":
        from kvtier.transfer.torch_copy import TorchTransfer

        return TorchTransfer(kv, quant)
    if backend in ("triton", "triton-direct"):
        if kv.split:
            raise ValueError(
                f"the Triton transfer does not take layout {kv.layout} (K and V apart): use torch"
            )
        if kv.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"the Triton transfer needs a CUDA device, the KV cache is on {kv.device} "
                "(set TRITON_INTERPRET=1 to run the kernels in Triton's interpreter for checks)"
            )
        from kvtier.transfer.triton_copy import TritonTransfer

        return TritonTransfer(
            kv,
            direct=backend == "triton-direct",
            quant=quant,
            upload=upload,
            store_piece=store_piece,
        )
    raise ValueError(f"unknown transfer backend {backend!r}: auto, torch, triton, triton-direct")
