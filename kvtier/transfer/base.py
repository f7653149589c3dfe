"""What a transfer is: the protocols every backend (triton_copy.py, torch_copy.py) implements."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from kvtier.transfer.addressed import AddressedGather


class Holds(Protocol):
    """What holds back some copies of an InFlight until the copy engine has room (pacing.py)."""

    def queue_through(self, flight: InFlight) -> None:
        """Queue every held copy up to `flight`'s last now: its `done` is known on return."""


class InFlight:
    """Copies to host chunks that were queued, not waited for: `done` completes once they
    have landed; `keep` (their device staging and tables) lives until then. Some may still be
    held back by `held` (pacing.py): asking for `done` queues them at once, since whoever
    asks needs the bytes; `arrived()` asks without that."""

    def __init__(
        self, done: torch.cuda.Event | None, keep: object = None, held: Holds | None = None
    ) -> None:
        self._done, self.keep, self._held = done, keep, held

    @property
    def done(self) -> torch.cuda.Event:
        if self._done is None and self._held is not None:
            self._held.queue_through(self)
        if self._done is None:
            raise RuntimeError("copies to the host neither queued nor held")
        return self._done

    def mark_queued(self, done: torch.cuda.Event) -> None:
        """Its last copy is queued: `done` is recorded behind it (by what held it)."""
        self._done = done

    @property
    def is_queued(self) -> bool:
        """Whether every copy has been queued (none is held back)."""
        return self._done is not None

    def arrived(self) -> bool:
        """Whether every copy was queued and has landed."""
        done = self._done
        return done is not None and done.query()


class LayerHandle(Protocol):
    """A layerwise load in flight."""

    def wait(self, layer: int) -> None:
        """Order the caller's work after layer `layer` is in the KV pages."""

    def finish(self) -> None:
        """Return once the host chunks are no longer read (they may be released)."""


class LayerSaver(Protocol):
    """A layerwise store in flight."""

    def save(self, layer: int) -> None:
        """Layer `layer`'s KV is written (on the caller's stream): move it out behind that."""

    def finish(self) -> None:
        """Return once every saved layer is in the host chunks."""

    def finish_later(self) -> InFlight | None:
        """`finish` without waiting: the caller's stream is ordered after every read of the
        KV (its pages may be written again); the host chunks must live until the returned
        copies have landed. None: every saved layer is there already."""

    def unsaved(self) -> list[int]:
        """The layers `save` was never called for."""


class Upload(Protocol):
    """Host chunks on their way to the device, queued before their slots are known."""

    def chunks(self) -> list[torch.Tensor]:
        """The chunks it carries, in order."""

    def wait(self) -> None:
        """Return once the host chunks are no longer read (they may be released)."""


class Transfer(Protocol):
    name: str

    def upload(
        self,
        chunks: Sequence[torch.Tensor],
        layer_major: bool = False,
        digests: bool = False,
        beside: bool = False,
        ready: Sequence[torch.cuda.Event | None] = (),
    ) -> Upload | None:
        """Queue the copies of `chunks` toward the device now, for a later `scatter`
        (`scatter_layerwise` with `layer_major`) that passes it as `upload`, once the
        slots are known; None where there is nothing to do ahead. `beside`: a load that
        runs beside the engine's steps (not inside one), whose copies must not hold the
        steps' own host-to-device inputs behind them. `ready`: per chunk (or empty), an
        event the chunk's copy waits for on the device (the copy down of a chunk a store
        has on its way), None for a chunk whose bytes are there."""

    def gather(
        self,
        slots: torch.Tensor,
        chunks: Sequence[torch.Tensor],
        digests: torch.Tensor | None = None,
        wait: bool = True,
    ) -> InFlight | None:
        """Fill `chunks` with the KV of `slots`. With `wait` (or where nothing runs beside
        the caller) the bytes have landed on return (None). Without it, on a GPU, the caller's
        stream is ordered after the reads of the KV, and the copies to the chunks are in flight."""

    def gather_addressed(
        self, slots: torch.Tensor, addresses: Sequence[int], chunk_tokens: int
    ) -> AddressedGather | None:
        """A gather of the chunks of `slots` into device memory at `addresses` (one per
        chunk of `chunk_tokens`, the last may be shorter), queued group by group by its
        `launch`; None where this transfer takes chunk tensors only (`gather`)."""

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
        """... `beside`: a load beside the engine's steps, on a stream of its own: its work
        runs there, after its upload's copies, and holds nothing shared with the steps' own
        loads and stores behind those copies.
        `digests` (Triton on a GPU only: int64 zeros, one per chunk): each chunk's KV
        digest (codec.kv_digest) is added there as its bytes arrive (gather: as they leave).
        Returns a function that waits until the host chunks are no longer read; that is
        already so with `wait`, otherwise the next batch's copies can be queued
        behind these before the caller waits (no idle gap between batches)."""

    def scatter_layerwise(
        self,
        slots: torch.Tensor,
        chunks: Sequence[torch.Tensor],
        digests: torch.Tensor | None = None,
        upload: Upload | None = None,
    ) -> LayerHandle: ...

    def gather_layerwise(
        self,
        slots: torch.Tensor,
        chunks: Sequence[torch.Tensor],
        digests: torch.Tensor | None = None,
    ) -> LayerSaver: ...
