"""The one way KV moves between the engine's paged cache and chunk buffers.

A chunk buffer holds one chunk as the transfers take it: [L, K, T, NH, HS] of the
KV's dtype, or the lossy codec's rows [L, K, T, R] uint8. The mover makes those
views, runs one transfer at a time (loads may run on a thread), and, on a GPU,
sums KV digests (codec.kv_digest) as chunks cross, so the load path hashes
nothing on the CPU.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvtier.codec import U64
from kvtier.keys import ChunkSpan, token_array
from kvtier.memory import HostPool, MemoryBlock, front_view
from kvtier.tiers.cpu import StoredChunk
from kvtier.transfer import InFlight, LayerHandle, LayerSaver, PagedKV, Quant, Transfer, Upload

Tokens = Sequence[int] | np.ndarray | torch.Tensor


class Mover:
    def __init__(self, kv: PagedKV, transfer: Transfer, quant: Quant | None) -> None:
        self.kv, self.transfer = kv, transfer
        # Bytes of one token in a chunk (the KV's own, or the codec's); `kv.bytes_per_token()`
        # stays the KV's, the bytes a load delivers.
        self.bytes_per_token = (
            kv.bytes_per_token() if quant is None else quant.bytes_per_token(kv.num_layers, kv.kv)
        )
        # A chunk's dtype, and its dimensions before and after T (asked once per chunk on
        # every load).
        self._dims: tuple[tuple[int, int], tuple[int, ...]]
        self._dtype, self._dims = (
            (kv.dtype, ((kv.num_layers, kv.kv), (kv.heads, kv.head_size)))
            if quant is None
            else (torch.uint8, ((kv.num_layers, kv.kv), (quant.row_bytes,)))
        )
        # Digests need a layer of a chunk in whole words.
        self.digests = (
            transfer.name == "triton"
            and kv.device.type == "cuda"
            and self.bytes_per_token // kv.num_layers % 4 == 0
        )
        self._lock = threading.Lock()
        # Where a finished layerwise load, or a landed store, reads its digest sums back: not the
        # caller's stream, which holds the whole forward queued since (it need not be over yet).
        self.readback = torch.cuda.Stream(kv.device) if self.digests else None

    def view(self, data: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """The chunk at the front of the byte buffer `data`."""
        before, after = self._dims
        return front_view(
            data if data.dtype == torch.uint8 else data.view(torch.uint8),
            self._dtype,
            (*before, num_tokens, *after),
        )

    def digest_sums(self, count: int) -> torch.Tensor | None:
        """Where a gather of `count` chunks adds their KV digests (None: not computed here)."""
        return (
            torch.zeros(count, dtype=torch.int64, device=self.kv.device)
            if self.digests and count
            else None
        )

    # -- paged KV → chunks ---------------------------------------------------------------

    def gather(
        self,
        slots: torch.Tensor,
        owned: list[tuple[ChunkSpan, MemoryBlock]],
        digests: torch.Tensor | None = None,
        wait: bool = True,
    ) -> InFlight | None:
        """The KV into the blocks: landed, their digests stamped (None), or, without `wait` on a
        GPU, in flight (stamp them once it has landed)."""
        spans, chunks = self._chunks(owned)
        with self._lock:
            flight = self.transfer.gather(
                concat_slots(slots, spans), chunks, digests=digests, wait=wait
            )
        if flight is None:
            stamp(owned, digests)
        return flight

    def gather_layerwise(
        self,
        slots: torch.Tensor,
        owned: list[tuple[ChunkSpan, MemoryBlock]],
        digests: torch.Tensor | None = None,
    ) -> LayerSaver:
        """The KV into the blocks as the caller saves each layer."""
        spans, chunks = self._chunks(owned)
        with self._lock:
            return self.transfer.gather_layerwise(
                concat_slots(slots, spans), chunks, digests=digests
            )

    def _chunks(
        self, owned: list[tuple[ChunkSpan, MemoryBlock]]
    ) -> tuple[list[ChunkSpan], list[torch.Tensor]]:
        """The spans, and the chunk in each block."""
        return [s for s, _ in owned], [self.view(b.data, s.num_tokens) for s, b in owned]

    def gather_into(
        self, slots: torch.Tensor, spans: Sequence[ChunkSpan], buffers: Sequence[torch.Tensor]
    ) -> None:
        """The KV of `spans` into byte buffers of the caller."""
        chunks = [self.view(buf, s.num_tokens) for s, buf in zip(spans, buffers)]
        with self._lock:
            self.transfer.gather(concat_slots(slots, spans), chunks)

    def gather_addressed(
        self,
        slots: torch.Tensor,
        spans: Sequence[ChunkSpan],
        places: Sequence[tuple[torch.Tensor, int]],
    ) -> Callable[[int, int], None]:
        """The KV of `spans` into device byte buffers, chunk i at `places[i]` (a buffer and a
        byte offset in it), queued chunks [first, end) at a time by the returned
        `launch(first, end)` on the current stream; the tables go up now, on it."""
        with self._lock:
            addressed = self.transfer.gather_addressed(
                concat_slots(slots, spans),
                [buf.data_ptr() + at for buf, at in places],
                spans[0].num_tokens,
            )
        if addressed is not None:
            return addressed.launch

        def launch(first: int, end: int) -> None:  # a transfer that takes tensors: a view per chunk
            views = [
                buf[at : at + s.num_tokens * self.bytes_per_token]
                for (buf, at), s in zip(places[first:end], spans[first:end])
            ]
            self.gather_into(slots, spans[first:end], views)

        return launch

    # -- chunks → paged KV ---------------------------------------------------------------

    def upload(
        self,
        held: list[tuple[ChunkSpan, StoredChunk]],
        layer_major: bool,
        beside: bool = False,
        ready: Sequence[torch.cuda.Event | None] = (),
    ) -> Upload | None:
        """Start the copies of host chunks toward the device (None: this transfer has no staging);
        `beside`: for a load beside the engine's steps; `ready`: per chunk, an event its copy
        waits for on the GPU (Transfer.upload)."""
        with self._lock:
            return self.transfer.upload(
                [self.view(c.block.data, s.num_tokens) for s, c in held],
                layer_major=layer_major,
                beside=beside,
                ready=ready,
            )

    def scatter(
        self,
        slots: torch.Tensor,
        found: list[tuple[ChunkSpan, StoredChunk]],
        start: int,
        end: int,
        wait: bool = True,
        upload: Upload | None = None,
        beside: bool = False,
    ) -> Callable[[], None]:
        """The chunks in one transfer, whole; what waits for the copies out of the chunks.
        A chunk cut by `start` or `end` writes only its tokens inside [start, end): the
        others get slot -1, which the transfers skip (the slots before `start` may be
        prefix-cache blocks the engine shares; after `end` there are no slots). `beside`:
        Transfer.scatter."""
        targets, views, digests = self._scatter_parts(slots, found, start, end, upload)
        with self._lock:
            return self.transfer.scatter(
                targets, views, wait=wait, digests=digests, upload=upload, beside=beside
            )

    def scatter_layerwise(
        self,
        slots: torch.Tensor,
        found: list[tuple[ChunkSpan, StoredChunk]],
        start: int,
        end: int,
        upload: Upload | None = None,
    ) -> LayerHandle:
        """The same chunks layer by layer (`scatter`'s cut at `start` and `end`): a handle."""
        targets, views, digests = self._scatter_parts(slots, found, start, end, upload)
        with self._lock:
            return self.transfer.scatter_layerwise(targets, views, digests=digests, upload=upload)

    def _scatter_parts(
        self,
        slots: torch.Tensor,
        found: list[tuple[ChunkSpan, StoredChunk]],
        start: int,
        end: int,
        upload: Upload | None,
    ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor | None]:
        """A scatter's target slots (-1 outside [start, end)), chunk views and device digests."""
        views = (
            upload.chunks()
            if upload is not None
            else [self.view(c.block.data, s.num_tokens) for s, c in found]
        )
        # lent chunks, checked on the GPU
        digests = found[0][1].block.device_check(len(found), self.kv.device)
        first, last = found[0][0].start, found[-1][0].end
        a, b = max(start, first), min(end, last)
        targets = torch.full((*slots.shape[:-1], last - first), -1, dtype=torch.int64)
        # slicing only: this runs before any byte moves
        targets[..., a - first : b - first] = slots[..., a:b]
        return targets, views, digests

    def device_idle(self) -> None:
        """Wait for everything queued on the KV's device (nothing to wait for on a host)."""
        if self.kv.device.type == "cuda":
            torch.cuda.synchronize(self.kv.device)

    def warm_up(self, pool: HostPool, chunk_size: int) -> None:
        """Run each copy path once, moving nothing (every slot -1): its kernels' compile or
        load, its streams and staging buffers cost the start, not the first requests."""
        block = pool.allocate()
        if block is None:
            return
        try:
            view = self.view(block.data, chunk_size)
            groups = self.kv.groups  # a grouped KV's kernels are their own variant
            nothing = torch.full(
                (groups, chunk_size) if groups > 1 else (chunk_size,), -1, dtype=torch.int64
            )
            with self._lock:
                t = self.transfer
                t.gather(nothing, [view], digests=self.digest_sums(1))
                t.scatter(nothing, [view])()
                t.scatter(nothing, [view], upload=t.upload([view]))()
                saver = t.gather_layerwise(nothing, [view], digests=self.digest_sums(1))
                for layer in range(self.kv.num_layers):
                    saver.save(layer)
                saver.finish()
                for upload in (None, t.upload([view], layer_major=True)):
                    loading = t.scatter_layerwise(nothing, [view], upload=upload)
                    for layer in range(self.kv.num_layers):
                        loading.wait(layer)
                    loading.finish()
            torch.cuda.synchronize(self.kv.device)
        finally:
            block.release()


def stamp(
    owned: list[tuple[ChunkSpan, MemoryBlock]],
    digests: torch.Tensor | None,
    readback: torch.cuda.Stream | None = None,
) -> None:
    """Each block's KV digest, once its gather is done (codec.kv_digest; 0: none). Where the
    flight that computed them is known done (its event), they are read on `readback`
    (`Mover.readback`): on the current stream the read waits for all that vLLM queued there
    since, and a store landed in `wait_for_save` made the host wait for that step's forward,
    so vLLM could not prepare its next step while the GPU ran this one (async scheduling)."""
    if digests is None:
        return
    with torch.cuda.stream(readback) if readback is not None else contextlib.nullcontext():
        values = digests.tolist()
    for (_, block), digest in zip(owned, values):
        block.digest = digest & U64


def as_numpy(tokens: Tokens) -> np.ndarray:
    if isinstance(tokens, torch.Tensor):
        return tokens.detach().cpu().numpy()
    return token_array(tokens)


def concat_slots(slots: torch.Tensor, spans: Sequence[ChunkSpan]) -> torch.Tensor:
    if len(spans) == 1 or all(a.end == b.start for a, b in zip(spans, spans[1:])):
        return slots[..., spans[0].start : spans[-1].end]
    return torch.cat([slots[..., s.start : s.end] for s in spans], dim=-1)


def num_tokens(chunks: Sequence[tuple[ChunkSpan, object]]) -> int:
    return sum(span.num_tokens for span, _ in chunks)


def release_blocks(chunks: Sequence[tuple[ChunkSpan, MemoryBlock]]) -> None:
    for _, block in chunks:
        block.release()


def release_held(chunks: Sequence[tuple[ChunkSpan, StoredChunk]]) -> None:
    for _, chunk in chunks:
        chunk.block.release()
