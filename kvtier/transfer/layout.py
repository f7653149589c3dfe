"""Paged KV layouts, and the one canonical view every transfer works on.

Engines keep KV in pages ("blocks") of `block_size` token slots, one tensor
per layer, in several layouts:

    flash_attn   [2, NB, BS, NH, HS]       K/V outermost
    flashinfer   [NB, 2, BS, NH, HS]       K/V inside the block
    mla          [NB, BS, HS]              one latent vector per token
    vllm         [NB, NH, BS, HS_k+HS_v]   vLLM >= 0.30's standardised per-layer
                                           view [B, H, N, C] (any stride order;
                                           MLA is NH == 1, C == HS)
    hf           [2, NB, NH, BS, HS]       transformers' [batch, heads, seq, dim]
                                           keys and values stacked; a sequence is
                                           one block of BS = max length slots

Each maps, by permuting and splitting dimensions only (no copy), onto

    canonical    [K, NB, BS, NH, HS]       K = 2 (K and V) or 1 (MLA)

with whatever strides the engine's memory has; the innermost HS must be
contiguous. Token slot s lives at block s // BS, offset s % BS.

A chunk in host memory is the contiguous tensor

    chunk        [L, K, T, NH, HS]         T = tokens in the chunk
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

Canon = Callable[[torch.Tensor, bool], torch.Tensor]


def _flash_attn(t: torch.Tensor, mla: bool) -> torch.Tensor:
    return t


def _flashinfer(t: torch.Tensor, mla: bool) -> torch.Tensor:
    return t.permute(1, 0, 2, 3, 4)


def _mla(t: torch.Tensor, mla: bool) -> torch.Tensor:
    return t.unsqueeze(0).unsqueeze(3)


def _vllm(t: torch.Tensor, mla: bool) -> torch.Tensor:
    nb, nh, bs, c = t.shape
    if mla:
        if nh != 1:
            raise ValueError(f"vLLM MLA KV view must have H == 1, got shape {tuple(t.shape)}")
        return t.permute(1, 0, 2, 3).unsqueeze(3)  # [1, NB, BS, 1, C]
    if c % 2:
        raise ValueError(f"vLLM KV view's C = K+V must be even, got shape {tuple(t.shape)}")
    # C = [K | V]: split it, then put K/V first and heads after tokens.
    return t.unflatten(3, (2, c // 2)).permute(3, 0, 2, 1, 4)


def _hf(t: torch.Tensor, mla: bool) -> torch.Tensor:
    return t.permute(0, 1, 3, 2, 4)


LAYOUTS: dict[str, Canon] = {
    "flash_attn": _flash_attn,
    "flashinfer": _flashinfer,
    "mla": _mla,
    "vllm": _vllm,
    "hf": _hf,
}
_NDIM = {"flash_attn": 5, "flashinfer": 5, "mla": 3, "vllm": 4, "hf": 5}


@dataclass(frozen=True)
class PagedKV:
    """An engine's per-layer KV tensors seen through the canonical view.

    `layers[i]` is layer i as [K, NB, BS, NH, HS]; all layers share shape,
    strides, dtype and device.
    """

    layout: str
    layers: tuple[torch.Tensor, ...]

    @classmethod
    def wrap(cls, tensors: Sequence[torch.Tensor], layout: str, mla: bool = False) -> PagedKV:
        if layout not in LAYOUTS:
            raise ValueError(f"unknown KV layout {layout!r}; known: {', '.join(LAYOUTS)}")
        if not tensors:
            raise ValueError("no KV cache tensors to register")
        for t in tensors:
            if t.dim() != _NDIM[layout]:
                raise ValueError(
                    f"layout {layout} wants {_NDIM[layout]}-D tensors, got shape {tuple(t.shape)}"
                )
        layers = tuple(LAYOUTS[layout](t, mla or layout == "mla") for t in tensors)
        first = layers[0]
        if first.stride(-1) != 1:
            raise ValueError("the innermost (head_size) dimension of the KV cache must be contiguous")
        for t in layers[1:]:
            if t.shape != first.shape or t.stride() != first.stride() or t.dtype != first.dtype:
                raise ValueError("all KV layers must share shape, strides and dtype")
        return cls(layout, layers)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def kv(self) -> int:
        return self.layers[0].shape[0]

    @property
    def num_blocks(self) -> int:
        return self.layers[0].shape[1]

    @property
    def block_size(self) -> int:
        return self.layers[0].shape[2]

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def heads(self) -> int:
        return self.layers[0].shape[3]

    @property
    def head_size(self) -> int:
        return self.layers[0].shape[4]

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].dtype

    @property
    def device(self) -> torch.device:
        return self.layers[0].device

    def chunk_shape(self, num_tokens: int) -> tuple[int, int, int, int, int]:
        return (self.num_layers, self.kv, num_tokens, self.heads, self.head_size)

    def bytes_per_token(self) -> int:
        return self.num_layers * self.kv * self.heads * self.head_size * self.dtype.itemsize
