"""Paged KV layouts, and the one canonical view every transfer works on.

Engines keep KV in pages ("blocks") of `block_size` token slots, one tensor
per layer, in several layouts. Most are named dimensions in some order
(DECLARED; an engine can also declare its own, as vLLM's backends do):

    flash_attn   [2, NB, BS, NH, HS]       K/V outermost
    flashinfer   [NB, 2, BS, NH, HS]       K/V inside the block
    mla          [NB, BS, HS]              one latent vector per token
    packed       [NB, NH, BS, 2*HS]        vLLM's GPU backends from 0.26 on:
                                           K|V in one content dimension, any
                                           stride order (NHD or HND in memory)
    hf           [2, NB, NH, BS, HS]       transformers' [batch, heads, seq, dim]
                                           keys and values stacked; a sequence is
                                           one block of BS = max length slots

vLLM's CPU backend has the packed shape but not its meaning: per (block,
head) it keeps BS*HS values of K, then of V, tokens ordered by its kernel:

    vllm         whole blocks only (any CPU kernel)
    vllm-cpu-vec per token, for the "vec" kernel (K transposed, V by token)

Each maps, by permuting and splitting dimensions only (no copy), onto

    canonical    [K, NB, BS, NH, HS]       K = 2 (K and V) or 1 (MLA)

with whatever strides the engine's memory has; the innermost HS must be
contiguous. Token slot s lives at block s // BS, offset s % BS.

A chunk in host memory is the contiguous tensor

    chunk        [L, K, T, NH, HS]         T = tokens in the chunk
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

# [K, NB, BS, NH, HS], or (K, V) each [NB, BS, NH, HS]
Layer = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
# A layout's view of one layer's tensor (the bool: MLA) as a canonical Layer.
Canon = Callable[[torch.Tensor, bool], Layer]

# The named dimensions a layout is declared in. KV_HEAD is K and V side by side in
# one dimension, K's HS values first (vLLM's standardised [B, H, N, 2*HS]).
BLOCKS, TOKENS, HEADS, HEAD, KV, KV_HEAD = "blocks", "tokens", "heads", "head", "kv", "kv_head"
CANONICAL = (KV, BLOCKS, TOKENS, HEADS, HEAD)
Dims = tuple[str, ...]

# Layouts that are a permutation (and split) of named dimensions.
DECLARED: dict[str, Dims] = {
    "flash_attn": (KV, BLOCKS, TOKENS, HEADS, HEAD),
    "flashinfer": (BLOCKS, KV, TOKENS, HEADS, HEAD),
    "mla": (BLOCKS, TOKENS, HEAD),
    "packed": (BLOCKS, HEADS, TOKENS, KV_HEAD),
    "hf": (KV, BLOCKS, HEADS, TOKENS, HEAD),
}


def canonical(t: torch.Tensor, dims: Dims) -> torch.Tensor:
    """`t`, whose dimensions are `dims`, as [K, NB, BS, NH, HS] (a view: no copy).
    A layout without KV (MLA's one latent vector) or without HEADS gets them as
    dimensions of size 1."""
    if (
        t.dim() != len(dims)
        or sorted(dims) != sorted(set(dims))
        or not set(dims) <= {*CANONICAL, KV_HEAD}
    ):
        raise ValueError(
            f"KV layout dims {dims} do not describe a {t.dim()}-D tensor of shape {tuple(t.shape)}"
        )
    if KV_HEAD in dims:
        if KV in dims or HEAD in dims:
            raise ValueError(f"KV layout dims {dims}: {KV_HEAD} holds both {KV} and {HEAD}")
        i = dims.index(KV_HEAD)
        if t.shape[i] % 2:
            raise ValueError(
                f"K and V packed in one dimension need an even size, "
                f"got {t.shape[i]} in {tuple(t.shape)}"
            )
        t = t.unflatten(i, (2, t.shape[i] // 2))
        dims = (*dims[:i], KV, HEAD, *dims[i + 1 :])
    for missing in (d for d in CANONICAL if d not in dims):
        if missing not in (KV, HEADS):
            raise ValueError(f"KV layout dims {dims} lack {missing!r}")
        t, dims = t.unsqueeze(-1), (*dims, missing)
    return t.permute(*(dims.index(d) for d in CANONICAL))


def _declared(dims: Dims) -> Canon:
    return lambda t, mla: canonical(t, dims)


def _vllm(t: torch.Tensor, mla: bool) -> torch.Tensor:
    """vLLM's CPU backend: [NB, NH, BS, C], where each (block, head) holds BS*C/2 values
    of K and then BS*C/2 of V (its attention views it as [NB, NH, 2*BS, C/2]). How the
    tokens lie inside those halves depends on the CPU kernel (see `_vllm_cpu_vec`), so
    this view is exact for whole blocks only: the connector then moves whole blocks."""
    nb, nh, bs, c = t.shape
    if mla:
        if nh != 1:
            raise ValueError(f"vLLM MLA KV view must have H == 1, got shape {tuple(t.shape)}")
        return t.permute(1, 0, 2, 3).unsqueeze(3)  # [1, NB, BS, 1, C]
    if c % 2:
        raise ValueError(f"vLLM KV view's C = K+V must be even, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError("vLLM's CPU KV cache must be contiguous (its attention views it so)")
    return t.view(nb, nh, 2, bs, c // 2).permute(2, 0, 3, 1, 4)


def _vllm_cpu_vec(t: torch.Tensor, mla: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's CPU backend with its "vec" attention kernel (x86 without AMX bf16): per
    (block, head), K is stored transposed, [C/2, BS], and V as [BS, C/2]. Exact per
    token. Returns (K, V), each [NB, BS, NH, HS]."""
    nb, nh, bs, c = t.shape
    if mla or c % 2 or not t.is_contiguous():
        raise ValueError(
            "layout vllm-cpu-vec wants a contiguous non-MLA [NB, NH, BS, 2*HS], "
            f"got {tuple(t.shape)}"
        )
    halves = t.view(nb, nh, 2, bs * (c // 2))
    k = halves[:, :, 0].view(nb, nh, c // 2, bs).permute(0, 3, 1, 2)
    v = halves[:, :, 1].view(nb, nh, bs, c // 2).permute(0, 2, 1, 3)
    return k, v


LAYOUTS: dict[str, Canon] = {name: _declared(dims) for name, dims in DECLARED.items()} | {
    "vllm": _vllm,
    "vllm-cpu-vec": _vllm_cpu_vec,
}
_NDIM = {name: len(dims) for name, dims in DECLARED.items()} | {"vllm": 4, "vllm-cpu-vec": 4}


@dataclass(frozen=True)
class PagedKV:
    """An engine's per-layer KV tensors seen through the canonical view.

    `layers[i]` is layer i as [K, NB, BS, NH, HS], or for layouts where K and V
    lie differently (vllm-cpu-vec) a pair (K, V) of [NB, BS, NH, HS]; all layers
    share shape, strides, dtype and device. `read`/`write` index either.
    """

    layout: str
    layers: tuple[Layer, ...]
    # Layer i's row of a slot table: an engine whose layers keep their tokens in pages of
    # their own (vLLM's KV cache groups with its hybrid allocator: sliding-window layers
    # beside full-attention ones) hands the transfers one row of slots per group, [G, T].
    # Empty: one group, slots [T].
    slot_rows: tuple[int, ...] = ()

    def grouped(self, rows: Sequence[int]) -> PagedKV:
        """These layers with layer i's slots in row rows[i] of a [G, T] slot table."""
        if len(rows) != self.num_layers or min(rows, default=0) < 0:
            raise ValueError(f"{len(rows)} slot rows for {self.num_layers} layers")
        return dataclasses.replace(self, slot_rows=tuple(int(r) for r in rows))

    @property
    def groups(self) -> int:
        """Rows of a slot table: 1 unless `grouped`."""
        return max(self.slot_rows, default=0) + 1

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
        return cls._of(
            layout, tuple(LAYOUTS[layout](t, mla or layout == "mla") for t in tensors), tensors
        )

    @classmethod
    def _of(
        cls, layout: str, layers: tuple[Layer, ...], tensors: Sequence[torch.Tensor]
    ) -> PagedKV:
        first = _first(layers[0])
        if isinstance(layers[0], torch.Tensor) and first.stride(-1) != 1:
            raise ValueError(
                "the innermost (head_size) dimension of the KV cache must be contiguous"
            )
        for t in tensors[1:]:
            if (
                t.shape != tensors[0].shape
                or t.stride() != tensors[0].stride()
                or t.dtype != tensors[0].dtype
            ):
                raise ValueError("all KV layers must share shape, strides and dtype")
        return cls(layout, layers)

    @classmethod
    def declared(cls, tensors: Sequence[torch.Tensor], dims: Dims, name: str) -> PagedKV:
        """Tensors whose dimensions an engine declared as `dims` (named `name` in errors
        and in `layout`)."""
        if not tensors:
            raise ValueError("no KV cache tensors to register")
        return cls._of(name, tuple(canonical(t, dims) for t in tensors), tensors)

    @property
    def split(self) -> bool:
        """True where K and V are separate tensors (only the torch transfer handles these)."""
        return not isinstance(self.layers[0], torch.Tensor)

    def joined(self) -> tuple[torch.Tensor, ...]:
        """The layers, each one [K, NB, BS, NH, HS] tensor; a ValueError where K and V are
        apart (`split`), which the Triton transfer's kernels do not take."""
        layers = tuple(t for t in self.layers if isinstance(t, torch.Tensor))
        if len(layers) != self.num_layers:
            raise ValueError(f"KV layout {self.layout} keeps K and V apart: use the torch transfer")
        return layers

    def _shape(self) -> tuple[int, ...]:
        layer = self.layers[0]
        return tuple(layer.shape) if isinstance(layer, torch.Tensor) else (2, *layer[0].shape)

    def read(self, layer: int, block: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        """[K, T, NH, HS]: the KV of the tokens at (block, offset)."""
        t = self.layers[layer]
        if isinstance(t, torch.Tensor):
            return t[:, block, offset]
        return torch.stack([t[0][block, offset], t[1][block, offset]])

    def write(
        self, layer: int, block: torch.Tensor, offset: torch.Tensor, tokens: torch.Tensor
    ) -> None:
        t = self.layers[layer]
        if isinstance(t, torch.Tensor):
            t[:, block, offset] = tokens
        else:
            t[0][block, offset] = tokens[0]
            t[1][block, offset] = tokens[1]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def kv(self) -> int:
        return self._shape()[0]

    @property
    def num_blocks(self) -> int:
        return self._shape()[1]

    @property
    def block_size(self) -> int:
        return self._shape()[2]

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def heads(self) -> int:
        return self._shape()[3]

    @property
    def head_size(self) -> int:
        return self._shape()[4]

    @property
    def dtype(self) -> torch.dtype:
        return _first(self.layers[0]).dtype

    @property
    def device(self) -> torch.device:
        return _first(self.layers[0]).device

    def chunk_shape(self, num_tokens: int) -> tuple[int, int, int, int, int]:
        return (self.num_layers, self.kv, num_tokens, self.heads, self.head_size)

    def bytes_per_token(self) -> int:
        return self.num_layers * self.kv * self.heads * self.head_size * self.dtype.itemsize


def _first(layer: Layer) -> torch.Tensor:
    return layer if isinstance(layer, torch.Tensor) else layer[0]
