"""What kvtier may hold past vLLM's own prefix-cache hit, known in the scheduler without asking.

A lookup makes vLLM's scheduler wait for the workers (0.8-1.1 ms a request inside vLLM on an
H200, every running request's next step waiting with it). Where vLLM's GPU cache has a prompt's
first `computed` tokens, kvtier adds to them only if it holds the span that covers token
`computed`: the chunk around it, or a shorter prompt's partial last chunk (a tail) that ends
past it. A chat turn whose previous turn is still in vLLM's cache has none: what kvtier stored
of that turn ends where vLLM's hit ends.

Where every chunk kvtier holds came from this scheduler's own saves (CPU RAM only: no disk that
outlives the process, no remote store, peers, PD or controller to bring others in), the
scheduler records each saved span's end under vLLM's block hash of the prefix up to the last
whole block before that end (`Request.block_hashes`, which already fold in the LoRA adapter,
images and cache_salt). A request with a GPU hit whose covering span was never saved is not
looked up.

The record over-counts, never under-counts: a save that failed or a chunk since evicted is
still in it (then the lookup is made, and finds less). A request whose block hashes do not
cover the span (prefix caching off: then vLLM has no hit either) is looked up. The record
keeps the most recent `capacity` prefixes; a longer-lived chunk is then not found past a GPU
hit (a miss, never wrong KV).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.config import KvtierConfig

CAPACITY = 1 << 17  # prefixes (~20 MB): 33M tokens of chunks of 256


def applies(config: KvtierConfig, can_save: bool, one_group: bool) -> bool:
    """Whether this engine's stores are the only way chunks reach its kvtier."""
    return (
        can_save
        and one_group
        and config.local_cpu
        and config.local_disk is None
        and config.remote_url is None
        and not config.enable_p2p
        and not config.enable_pd
        and not config.enable_controller
    )


class StoredEnds:
    """The ends of the spans this engine saved, by vLLM's block hash of the prefix before
    each end's last partial block (`block` tokens a hash)."""

    def __init__(self, block: int, chunk_size: int, capacity: int = CAPACITY) -> None:
        self.block, self.chunk_size, self.capacity = block, chunk_size, capacity
        # block hash of tokens [0, (i + 1) * block) -> ends in [(i + 1) * block, (i + 2) * block)
        self._ends: OrderedDict[object, tuple[int, ...]] = OrderedDict()
        self.usable = True  # False once a save could not be recorded: every request is asked

    def saved(self, hashes: Sequence[object] | None, num_tokens: int, start: int, end: int) -> None:
        """A save of tokens [start, end) of a request of `num_tokens` tokens (None: a request
        never looked up): the ends of its whole chunks, and `end` (its partial last chunk's,
        if it has one)."""
        if not self.usable:
            return
        if hashes is None or not self._hashed(hashes, max(num_tokens, end)):
            self.usable = False  # its chunks could not be told apart from ones never saved
            self._ends.clear()
            return
        size = self.chunk_size
        ends = list(range((start // size + 1) * size, end + 1, size))
        if not ends or ends[-1] != end:
            ends.append(end)
        for e in ends:
            if e < self.block:
                continue  # before any whole block: nothing vLLM's cache has ends past it
            key = hashes[e // self.block - 1]
            known = self._ends.get(key, ())
            if e not in known:
                self._ends[key] = (*known, e)
            self._ends.move_to_end(key)
        while len(self._ends) > self.capacity:
            self._ends.popitem(last=False)

    def may_add(
        self,
        hashes: Sequence[object],
        num_tokens: int,
        prompt_len: int,
        computed: int,
        loads: Callable[[int], int],
    ) -> bool:
        """Whether kvtier may hold a span of this prompt that covers token `computed` (the
        first vLLM's cache lacks) and from which `loads(end)` tokens would load."""
        if not self.usable or computed < self.block or not self._hashed(hashes, num_tokens):
            return True
        size = self.chunk_size
        covering = min((computed // size + 1) * size, prompt_len)  # the covering span's end
        first = max(computed // self.block - 1, 0)
        for i in range(first, covering // self.block):
            for e in self._ends.get(hashes[i], ()):
                if computed < e <= covering and (e % size == 0 or loads(e)):
                    return True  # a whole chunk (more may follow it), or a tail that loads
        return False

    def _hashed(self, hashes: Sequence[object], num_tokens: int) -> bool:
        """Whether vLLM hashed every whole block of the request (with prefix caching, in
        blocks of this size)."""
        return len(hashes) == num_tokens // self.block
