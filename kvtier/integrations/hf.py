"""kvtier for Hugging Face transformers causal LMs (batch size 1).

    session = HFSession(model, config, max_len=32768)
    ids = session.generate(input_ids, max_new_tokens=32)

A session owns one KV buffer per layer, [2, 1, H, max_len, D] (keys and
values of transformers' [batch, heads, seq, dim] stacked), handed to the
model as a static cache. To the CacheEngine that buffer is a paged cache of
one block of `max_len` slots, where token i lives in slot i, so store,
lookup, retrieve and the Triton kernels are the ones vLLM uses.

`prefill`: look up the stored prefix, load it into the buffer, run the
model on the remaining tokens only, store the new chunks. Layerwise, the
cache object's update of layer i is where layer i's load is waited for
and where its store starts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import Cache, StaticLayer

from kvtier.config import KvtierConfig
from kvtier.engine import CacheEngine
from kvtier.keys import KVFormat
from kvtier.logs import get_logger
from kvtier.transfer import PagedKV

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = get_logger(__name__)


Hook = Callable[[int], None]


class _BufferLayer(StaticLayer):
    """transformers' static layer over views of a kvtier-owned buffer.

    `before_update(index)` runs when the model reaches this layer, before
    its attention reads the cache: that is where a layerwise load waits.
    `after_update(index)` runs once the layer's new keys and values are in
    the buffer: that is where a layerwise store takes them.
    """

    def __init__(
        self,
        buffer: torch.Tensor,
        index: int,
        before_update: Hook | None,
        after_update: Hook | None,
    ) -> None:
        super().__init__(max_cache_len=buffer.shape[3])
        self.index, self.before_update, self.after_update = index, before_update, after_update
        self.keys, self.values = buffer[0], buffer[1]
        self.dtype, self.device = buffer.dtype, buffer.device
        self.batch_size, self.num_heads = 1, buffer.shape[2]
        self.k_head_dim = self.v_head_dim = buffer.shape[4]
        self.cumulative_length = torch.tensor(0, dtype=torch.long, device=buffer.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.before_update is not None:
            self.before_update(self.index)
        out = super().update(key_states, value_states, *args, **kwargs)
        if self.after_update is not None:
            self.after_update(self.index)
        return out


class KvtierCache(Cache):
    """A static cache whose layers are views of the session's buffers."""

    def __init__(
        self,
        buffers: list[torch.Tensor],
        length: int,
        before_update: Hook | None = None,
        after_update: Hook | None = None,
    ) -> None:
        super().__init__(
            layers=[_BufferLayer(b, i, before_update, after_update) for i, b in enumerate(buffers)]
        )
        for layer in self.layers:
            layer.cumulative_length.fill_(length)

    def detach_hooks(self) -> None:
        """Decoding after the prefill neither loads nor stores."""
        for layer in self.layers:
            layer.before_update = layer.after_update = None


@dataclass
class PrefillResult:
    logits: torch.Tensor  # [1, vocab] of the last prompt token
    cache: KvtierCache
    hit_tokens: int


class HFSession:
    def __init__(
        self, model: PreTrainedModel, config: KvtierConfig, max_len: int, *, transfer: str = "auto"
    ) -> None:
        cfg = model.config
        heads = cfg.num_key_value_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        param = next(model.parameters())
        self.model = model
        self.max_len = max_len
        self.buffers = [
            torch.zeros(2, 1, heads, max_len, head_dim, dtype=param.dtype, device=param.device)
            for _ in range(cfg.num_hidden_layers)
        ]
        kv = PagedKV.wrap(self.buffers, "hf")
        fmt = KVFormat(
            cfg.name_or_path or cfg.model_type, "hf", str(param.dtype).removeprefix("torch.")
        )
        self.engine = CacheEngine(config, kv, fmt, transfer=transfer)

    @torch.inference_mode()
    def prefill(
        self, input_ids: torch.Tensor, *, use_cache: bool = True, layerwise: bool | None = None
    ) -> PrefillResult:
        """Run the prompt; with `use_cache`, load its stored prefix and store the rest.

        `layerwise` (default: the config's `use_layerwise`) loads layer i+1
        while layer i computes, and stores layer i while later layers
        compute, instead of loading everything first and storing after.
        """
        layerwise = self.engine.config.use_layerwise if layerwise is None else layerwise
        ids = input_ids.reshape(-1)
        n = ids.numel()
        if n > self.max_len:
            raise ValueError(f"prompt of {n} tokens exceeds the session's max_len {self.max_len}")
        tokens = ids.cpu()
        slots = torch.arange(n)
        hit, load, storing, store = 0, None, None, use_cache
        if use_cache:
            # All but the last token: the model must run that one to give its
            # logits. The load stops at the first chunk not stored.
            load = self.engine.start_retrieve(tokens, slots[: n - 1], layerwise=layerwise)
            hit = load.num_tokens
            size = self.engine.chunk_size
            # The tokens the forward computes lie in the chunk the load ended inside: stored
            # already.
            store = not (hit % size and (n - 1) // size == hit // size)
            if layerwise and store:
                storing = self.engine.start_store(tokens, slots, start=hit, layerwise=True)
        cache = KvtierCache(
            self.buffers,
            hit,
            before_update=load.wait if load else None,
            after_update=storing.save if storing else None,
        )
        try:
            out = self.model(
                input_ids=ids[None, hit:].to(self.buffers[0].device),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
        except BaseException:
            if storing is not None:
                storing.cancel()
            raise
        finally:
            loaded = int(load.finish().sum()) if load is not None else 0
            cache.detach_hooks()
        if loaded < hit:  # a chunk lent layer by layer failed its check after the forward read it
            if storing is not None:
                storing.cancel()
            log.warning(
                "%d of %d loaded tokens failed their check: the prompt is computed again",
                hit - loaded,
                hit,
            )
            return self.prefill(input_ids, use_cache=False)
        if storing is not None:
            storing.finish()
        elif store:
            self.engine.store(tokens, slots, start=hit)
        return PrefillResult(out.logits[:, -1], cache, hit)

    @torch.inference_mode()
    def generate(
        self, input_ids: torch.Tensor, max_new_tokens: int, *, use_cache: bool = True
    ) -> list[int]:
        """Greedy decoding after a kvtier prefill; returns the new token ids."""
        n = input_ids.numel()
        if n + max_new_tokens > self.max_len:
            raise ValueError(
                f"{n} + {max_new_tokens} tokens exceed the session's max_len {self.max_len}"
            )
        result = self.prefill(input_ids, use_cache=use_cache)
        token = result.logits.argmax(-1)
        out = [int(token)]
        for _ in range(max_new_tokens - 1):
            logits = self.model(
                input_ids=token[:, None], past_key_values=result.cache, use_cache=True
            ).logits
            token = logits[:, -1].argmax(-1)
            out.append(int(token))
        return out
