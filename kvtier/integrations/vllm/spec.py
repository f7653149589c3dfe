"""What the two sides of the connector share: the config read from vLLM's, the
metadata the scheduler sends the workers each step, and the rule for a usable hit."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvtier.config import KvtierConfig, load_config
from kvtier.errors import ConfigError
from kvtier.integrations.vllm.layout import cpu_kernel_layout
from kvtier.keys import PLAIN, Identity
from kvtier.pd.sender import Target

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# kv_connector_extra_config keys of LMCache's connector that kvtier honours.
# lmcache_rpc_port names LMCache's scheduler-worker socket; kvtier's are named by
# the engine id, so it is accepted and has no effect. Besides these, any config key
# with LMCache's "lmcache." prefix (or "kvtier.") sets that key, over file and env.
EXTRA_KEYS = {"discard_partial_chunks", "lmcache_rpc_port"}
CONFIG_PREFIXES = ("lmcache.", "kvtier.")


@dataclass
class TransferSpec:
    """Tokens [start, end) of a request to load or save, worker-side."""

    req_id: str
    token_ids: list[int]  # the prompt up to `end` or beyond (for keys)
    # per KV cache group (one unless vLLM's hybrid allocator makes several)
    block_ids: list[list[int]]
    start: int
    end: int
    # load beside the steps, asynchronously (chunks below CPU RAM; async_loading)
    background: bool = False
    # background: the hit was all in CPU RAM at the lookup (held since): nothing blocks
    from_cpu: bool = False
    pd_target: Target | None = None  # save: push these chunks to a decoder (PD sender)
    last: bool = False  # save: the prompt's last chunk is in this one
    # save: the step ended at `end`, on a block end: a hybrid model's Mamba state is kept there
    state: bool = False
    pd_req_id: str = ""  # load: the proxy's id of this request; its PD chunks are freed once loaded
    # load in the request's first step: its tokens computed after it (0: a background load)
    step_end: int = 0
    # what besides the tokens decides their KV (its adapter, images, salt: keys.py)
    identity: Identity = PLAIN

    def slots(self, block_size: int, groups: Sequence[int] | None = None) -> torch.Tensor:
        """The slots of tokens [0, end) in the attention groups `groups` (default: every
        group): [T] for one, else [G, T], a row per group, -1 where the group holds vLLM's
        null block (block 0: a sliding window's tokens it no longer keeps; kvtier neither
        reads nor writes them there)."""
        n, offsets = self.end, torch.arange(block_size, dtype=torch.int64)
        tables = self.block_ids if groups is None else [self.block_ids[g] for g in groups]
        rows = [
            (
                torch.tensor(ids[: -(-n // block_size)], dtype=torch.int64)[:, None] * block_size
                + offsets[None, :]
            ).flatten()[:n]
            for ids in tables
        ]
        if len(rows) <= 1:
            return rows[0] if rows else torch.empty(0, dtype=torch.int64)
        table = torch.stack(rows)
        table[table < block_size] = -1
        return table

    def blocks_of(self, first: int, last: int) -> set[int]:
        """Every group's blocks [first, last] (vLLM's null block left out)."""
        return {
            b
            for ids in self.block_ids
            for b in ids[first : last + 1]
            if b or len(self.block_ids) == 1
        }


@dataclass
class KvtierMetadata(KVConnectorMetadata):
    loads: list[TransferSpec] = field(default_factory=list)
    saves: list[TransferSpec] = field(default_factory=list)
    # PD sender: proxy ids of requests whose pages vLLM freed before their last step
    # (preempted, or finished early): their queued writes must read them before the next forward
    pd_dropped: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Shape:
    """What both sides know of vLLM's KV before any tensor exists."""

    block_size: int
    chunk_size: int
    # vLLM's CPU kernels other than "vec" lay out tokens inside a block their own way:
    # kvtier then moves whole blocks, and a hit must end on a block boundary.
    whole_blocks: bool
    min_retrieve_tokens: int
    # vLLM replays a full CUDA graph for a step of one token a request (its compiled mode's
    # FULL_AND_PIECEWISE), and runs a longer one piecewise, the attention of each layer
    # launched from Python in between
    full_graphs: bool = False

    def usable(self, stored: int, prompt_len: int) -> int:
        """The tokens of a stored prefix vLLM is told of."""
        return usable_hit(
            stored,
            prompt_len,
            self.block_size if self.whole_blocks else 1,
            self.min_retrieve_tokens,
        )

    def to_load(self, stored: int, prompt_len: int, computed: int) -> int:
        """The tokens to load past the `computed` that vLLM has (the same rule on both sides):
        none where that is less than a block, unless it leaves the step the prompt's last
        token alone under `full_graphs`. Eager, or piecewise anyway, the step computes the
        last token and a few more at no cost, less than a load's own launches and wait (on an
        H100, inside vLLM, the 15 tokens past a GPU hit of 4,336 took 2.4 ms to load). With
        full graphs those 16 tokens ran piecewise: vLLM's own GPU hit of a prompt again at
        16k took 31.5 ms against native offloading's 22.6, which loads its last block from
        CPU RAM and computes one token (an H200, the multiprocess engine, 2026-11-30)."""
        need = max(0, self.usable(stored, prompt_len) - computed)
        if need >= self.block_size or computed == 0:
            return need
        return need if self.full_graphs and computed + need == prompt_len - 1 else 0


def shape_of(config: KvtierConfig, vllm_config: VllmConfig) -> Shape:
    shape = Shape(
        vllm_config.cache_config.block_size,
        config.chunk_size,
        _cpu_whole_blocks(vllm_config),
        config.min_retrieve_tokens,
        _full_graphs(vllm_config),
    )
    if shape.whole_blocks and shape.chunk_size % shape.block_size:
        raise ConfigError(
            "chunk_size",
            shape.chunk_size,
            f"a multiple of vLLM's block size {shape.block_size}: this CPU's attention kernel "
            "stores tokens inside a block its own way, so kvtier moves whole blocks",
        )
    return shape


def connector_config(vllm_config: VllmConfig) -> KvtierConfig:
    """kvtier config from file/env, plus LMCache-style extra config from vLLM."""
    config = config_with_extra(vllm_config.kv_transfer_config.kv_connector_extra_config)
    check_pd_role(config, vllm_config.kv_transfer_config.kv_role)
    return config


def config_with_extra(extra: dict[str, Any] | None) -> KvtierConfig:
    """The config from file and env, with kv_connector_extra_config's keys over them."""
    extra = extra or {}
    overrides: dict[str, Any] = {}
    for key, value in extra.items():
        prefix = next((p for p in CONFIG_PREFIXES if key.startswith(p)), None)
        if prefix is not None:
            overrides[key[len(prefix) :]] = value
        elif key not in EXTRA_KEYS:
            raise ValueError(
                f"kv_connector_extra_config: unknown key {key!r}; kvtier reads "
                f"{sorted(EXTRA_KEYS)} and config keys prefixed "
                f"{' or '.join(map(repr, CONFIG_PREFIXES))} there, and everything "
                "else from its config file or env"
            )
    if "discard_partial_chunks" in extra:
        overrides["save_unfull_chunk"] = not _as_bool(extra["discard_partial_chunks"])
    return load_config(overrides=overrides)


def check_pd_role(config: KvtierConfig, kv_role: str) -> None:
    """A PD sender computes and saves (kv_producer); a receiver loads (kv_consumer)."""
    if not config.enable_pd:
        return
    wanted = {"sender": "kv_producer", "receiver": "kv_consumer"}[config.pd_role or ""]
    if kv_role not in (wanted, "kv_both"):
        raise ConfigError(
            "pd_role",
            config.pd_role,
            f"a role matching vLLM's kv_role {kv_role!r}: pd_role {config.pd_role} "
            f"runs with kv_role {wanted}",
        )


def _full_graphs(vllm_config: VllmConfig) -> bool:
    """Whether vLLM runs a step of one token a request as a full CUDA graph (Shape.full_graphs):
    its compiled mode's full graphs on, and no speculative decoding (whose decode steps are
    longer)."""
    mode = vllm_config.compilation_config.cudagraph_mode
    return (
        mode is not None
        and mode.has_full_cudagraphs()
        and not vllm_config.model_config.enforce_eager
        and vllm_config.speculative_config is None
    )


def _cpu_whole_blocks(vllm_config: VllmConfig) -> bool:
    """Whether vLLM's KV moves in whole blocks here: on a CPU whose attention kernel is not
    "vec" (layout.py). Known to the scheduler, which has no KV tensors to look at. An MLA
    model's CPU backend (CPU_MLA) keeps one latent row a token, in the tokens' order."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or vllm_config.model_config.use_mla:
        return False
    return cpu_kernel_layout(vllm_config) == "vllm"


def usable_hit(hit: int, prompt_len: int, granularity: int, min_tokens: int) -> int:
    """The tokens of a stored prefix vLLM can be told of: at most all but the last prompt
    token (vLLM computes at least one to get logits), whole blocks where the KV layout
    needs them (`granularity`), and none below `min_retrieve_tokens`."""
    hit = min(hit, prompt_len - 1)
    hit -= hit % granularity
    return hit if hit >= max(min_tokens, 1) else 0


def _as_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if str(value).strip().lower() in {"true", "1", "yes"}:
        return True
    if str(value).strip().lower() in {"false", "0", "no"}:
        return False
    raise ValueError(f"discard_partial_chunks = {value!r}: expected true or false")
