"""vLLM's KV cache groups, as kvtier moves them.

vLLM's hybrid allocator (on, since the connector says `SupportsHMA`) gives a
model's layers of each kind blocks of their own, a group per kind (several
groups of equal layer counts where one kind has more layers):

    full attention          every token's KV, kept
    sliding window          every token's KV, its blocks freed as the window passes
    Mamba (recurrent)       no KV a token: one fixed-size state a layer, in a block that
                            vLLM's `--mamba-cache-mode align` keeps at each prefill step's end

Attention groups are rows of the [G, T] slot tables (`PagedKV.grouped`); the
Mamba groups' state is stored as snapshots at chunk ends (engine/states.py).
In align mode the block with the state after token e-1 is block e/B - 1 of the
request's Mamba table, and vLLM makes prefill steps end on block boundaries, so
kvtier's chunks must end on them too: the chunk size is a divisor of the block
size, or the block size.

A sliding layer's token is read by a hit ending less than a window after it. A hit
ends on a chunk end, so a chunk no longer than the smallest window holds no sliding
token that no hit reads: where the window is shorter than the configured chunk
(gpt-oss: 128 tokens), the chunk size becomes the largest divisor of the configured
one within the window. Every byte stored is then read by a hit at some chunk end.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from math import prod
from typing import TYPE_CHECKING

import torch

from kvtier.config import KvtierConfig
from kvtier.engine.states import StateLayers
from kvtier.errors import UnsupportedModel
from kvtier.logs import get_logger

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = get_logger(__name__)


@dataclass(frozen=True)
class KvGroups:
    """Which of vLLM's KV cache groups hold attention KV and which a recurrent state."""

    attention: tuple[int, ...]  # in order: their rows of the slot tables
    recurrent: tuple[int, ...]
    layer_group: dict[str, int]
    block_size: int  # every group's
    window: int | None = None  # the smallest sliding window of the attention groups, in tokens

    @property
    def has_state(self) -> bool:
        return bool(self.recurrent)

    def rows(self, names: Sequence[str]) -> list[int] | None:
        """The slot-table row of each attention layer of `names`; None for one attention group
        (slots [T])."""
        if len(self.attention) <= 1:
            return None
        missing = [n for n in names if self.layer_group.get(n) not in self.attention]
        if missing:
            raise UnsupportedModel(
                f"vLLM's KV cache groups: layers {', '.join(missing[:3])} in no attention "
                "group; kvtier needs every KV layer in one"
            )
        return [self.attention.index(self.layer_group[n]) for n in names]

    def state_blocks(
        self, block_ids: Sequence[Sequence[int]], end: int, names: Sequence[str]
    ) -> list[int] | None:
        """Per recurrent layer of `names`, its block holding the state after token end-1
        (align mode: block end/B - 1 of its group); None where a group has no block there
        (vLLM's null block 0: that state was not kept)."""
        at = end // self.block_size - 1
        out = []
        for name in names:
            ids = block_ids[self.layer_group[name]]
            if at < 0 or at >= len(ids) or ids[at] == 0:
                return None
            out.append(ids[at])
        return out

    def chunk_size(self, config: KvtierConfig) -> KvtierConfig:
        """`config` with the chunk size these groups need: no longer than the smallest sliding
        window (the largest divisor of the configured one within it), and with chunk ends on
        every block end where a recurrent state can be kept (the block size where the chunk
        does not divide it). Logged where it changes."""
        size = config.chunk_size
        if self.window is not None and self.window < size:
            size = max(d for d in range(1, self.window + 1) if config.chunk_size % d == 0)
            log.info(
                "a sliding-window layer reads only the last %d tokens before a hit: kvtier's "
                "chunk_size %d -> %d so that a chunk holds no sliding token that no hit reads",
                self.window,
                config.chunk_size,
                size,
            )
        if self.has_state and self.block_size % size:
            log.info(
                "a hybrid model's Mamba state is kept only at vLLM's block ends (%d tokens): "
                "kvtier's chunk_size %d -> %d so that chunks end there",
                self.block_size,
                size,
                self.block_size,
            )
            size = self.block_size
        return config if size == config.chunk_size else replace(config, chunk_size=size)


def kv_groups(kv_cache_config: KVCacheConfig | None) -> KvGroups | None:
    """The groups of `kv_cache_config`; None for one attention group (or none known).
    Refused, naming the reason: a group that is neither attention nor a Mamba state vLLM
    keeps at block ends (`--mamba-cache-mode align`), or groups of differing block sizes."""
    groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
    from vllm.v1.kv_cache_interface import (
        AttentionSpec,
        MambaSpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )

    attention, recurrent, of, sizes = [], [], {}, set()
    windows: set[int] = set()  # the attention groups' sliding windows, in tokens
    for g, group in enumerate(groups):
        spec = group.kv_cache_spec
        specs = (
            list(spec.kv_cache_specs.values())
            if isinstance(spec, UniformTypeKVCacheSpecs)
            else [spec]
        )
        what = (
            f"KV cache group {g} ({type(spec).__name__}, layers {', '.join(group.layer_names[:3])}"
            f"{'...' if len(group.layer_names) > 3 else ''})"
        )
        if all(isinstance(s, AttentionSpec) for s in specs):
            attention.append(g)
            windows.update(s.sliding_window for s in specs if isinstance(s, SlidingWindowSpec))
        elif isinstance(spec, MambaSpec):
            if spec.mamba_cache_mode != "align" or spec.num_speculative_blocks:
                raise UnsupportedModel(
                    f"{what} holds a Mamba or linear-attention state kept in mode "
                    f"{spec.mamba_cache_mode!r}"
                    f"{' with speculative blocks' if spec.num_speculative_blocks else ''}: "
                    "kvtier stores that state where vLLM keeps it at block ends; run vLLM with "
                    "--mamba-cache-mode align (and prefix caching on), without speculative "
                    "decoding"
                )
            recurrent.append(g)
        else:
            raise UnsupportedModel(
                f"{what} holds neither attention KV nor a Mamba state: kvtier cannot store it; "
                "run this model without kvtier's connector"
            )
        sizes.add(spec.block_size)
        of.update(dict.fromkeys(group.layer_names, g))
    if len(groups) <= 1 and not recurrent:
        return None
    if len(sizes) > 1:
        raise UnsupportedModel(
            f"vLLM's KV cache groups: block sizes {sorted(sizes)} differ; kvtier needs "
            "all of one block size"
        )
    return KvGroups(tuple(attention), tuple(recurrent), of, sizes.pop(), min(windows, default=None))


def state_layers(
    kv_caches: dict[str, torch.Tensor | list[torch.Tensor]], names: Sequence[str]
) -> StateLayers:
    """The Mamba layers `names` as kvtier's StateLayers. vLLM hands each such layer a list
    of state tensors [num_blocks, *shape] (conv, SSM), views of one buffer whose block b is
    the page at b * page bytes, the states one after another at its front: a layer's block
    is one run of bytes. Anything else is refused, naming what was found."""
    pages = []
    for name in names:
        states = kv_caches[name]
        first = states[0]
        page = first.stride(0) * first.element_size()
        start = at = first.storage_offset() * first.element_size()
        for t in states:
            inner = torch.empty(t.shape[1:], device="meta").stride()
            if (
                t.stride(0) * t.element_size() != page
                or tuple(t.stride()[1:]) != inner
                or t.storage_offset() * t.element_size() != at
                or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
            ):
                raise UnsupportedModel(
                    f"layer {name}: vLLM's Mamba state tensors {[tuple(x.shape) for x in states]} "
                    f"strides {[x.stride() for x in states]} are not the states of a block one "
                    "after another in its page"
                )
            at += prod(t.shape[1:]) * t.element_size()
        if at - start > page:
            raise UnsupportedModel(
                f"layer {name}: a Mamba state of {at - start} bytes in pages of {page}"
            )
        view = torch.empty(0, dtype=torch.uint8, device=first.device)
        view.set_(first.untyped_storage(), start, (first.shape[0], at - start), (page, 1))
        pages.append(view)
    return StateLayers(pages)
