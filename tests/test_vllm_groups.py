"""vLLM's KV cache groups as kvtier moves them (kvtier/integrations/vllm/groups.py): attention
groups are rows of the slot tables, Mamba groups (align mode) a state stored at chunk ends."""

import pytest
import torch
from vllm_requests import vllm_request

from kvtier.config import KvtierConfig
from kvtier.errors import UnsupportedModel
from kvtier.integrations.vllm.groups import kv_groups, state_layers
from kvtier.integrations.vllm.spec import TransferSpec

pytestmark = pytest.mark.vllm


def kv_cache_config(*groups):
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    return KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(names, spec) for names, spec in groups],
    )


def attention(window=None, block_size=16):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    if window is None:
        return FullAttentionSpec(
            block_size=block_size, num_kv_heads=2, head_size=64, dtype=torch.bfloat16
        )
    return SlidingWindowSpec(
        block_size=block_size,
        num_kv_heads=2,
        head_size=64,
        dtype=torch.bfloat16,
        sliding_window=window,
    )


def mamba(block_size=16, mode="align"):
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(
        block_size=block_size,
        shapes=((3, 40), (4, 8, 16)),
        dtypes=(torch.bfloat16, torch.float32),
        mamba_cache_mode=mode,
    )


def test_vllms_kv_cache_groups_give_each_layer_its_row_of_the_slot_table():
    """vLLM's hybrid allocator (kvtier says SupportsHMA): a Gemma-3-style model's sliding
    layers in groups of their own; each layer's row is its group's."""
    names = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    assert kv_groups(kv_cache_config((names, attention()))) is None  # one group: slots [T]
    two = kv_groups(kv_cache_config(([names[3]], attention()), (names[:3], attention(128))))
    assert two.rows(names) == [1, 1, 1, 0] and not two.has_state
    with pytest.raises(UnsupportedModel, match="block sizes"):
        kv_groups(kv_cache_config(([names[3]], attention()), (names[:3], attention(128, 32))))


def test_a_sliding_window_shorter_than_a_chunk_makes_the_chunk_fit_in_it():
    """A hit ends on a chunk end and reads a sliding layer's last window before it: a chunk
    no longer than the window holds no sliding token that no hit reads (gpt-oss: 128)."""
    names = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    groups = kv_groups(kv_cache_config(([names[3]], attention()), (names[:3], attention(128))))
    assert groups.window == 128
    assert groups.chunk_size(KvtierConfig(chunk_size=256)).chunk_size == 128
    # within the window: kept
    assert groups.chunk_size(KvtierConfig(chunk_size=96)).chunk_size == 96
    odd = kv_groups(
        kv_cache_config(
            ([names[3]], attention()), (names[:2], attention(100)), ([names[2]], attention(1024))
        )
    )
    assert odd.window == 100 and odd.chunk_size(KvtierConfig(chunk_size=256)).chunk_size == 64
    wide = kv_groups(kv_cache_config(([names[3]], attention()), (names[:3], attention(1024))))
    assert wide.chunk_size(KvtierConfig(chunk_size=256)).chunk_size == 256


def test_mamba_groups_are_state_kept_at_block_ends_and_other_modes_are_refused_naming_the_fix():
    groups = kv_groups(
        kv_cache_config(
            (["a0", "a1"], attention(block_size=144)),
            (["m0", "m1"], mamba(144)),
            (["m2", "m3"], mamba(144)),
        )
    )
    assert (
        groups.attention == (0,)
        and groups.recurrent == (1, 2)
        and groups.rows(["a0", "a1"]) is None
    )
    # Chunks must end on the block ends where vLLM keeps a state: 256 does not divide 144.
    assert groups.chunk_size(KvtierConfig(chunk_size=256)).chunk_size == 144
    assert groups.chunk_size(KvtierConfig(chunk_size=48)).chunk_size == 48
    for mode in ("none", "all"):
        with pytest.raises(UnsupportedModel, match="--mamba-cache-mode align"):
            kv_groups(kv_cache_config((["a"], attention()), (["m"], mamba(mode=mode))))


def test_the_state_after_a_block_end_is_in_that_blocks_place_of_the_mamba_table():
    groups = kv_groups(kv_cache_config((["a"], attention()), (["m0"], mamba()), (["m1"], mamba())))
    ids = [[1, 2, 3, 4], [0, 0, 7, 8], [0, 5, 6, 0]]
    assert groups.state_blocks(ids, 48, ["m0", "m1"]) == [7, 6]
    # vLLM kept no state there (null block)
    assert groups.state_blocks(ids, 32, ["m0", "m1"]) is None
    assert groups.state_blocks(ids, 64, ["m0", "m1"]) is None
    spec = TransferSpec("r", list(range(40)), ids, 0, 40)
    assert spec.slots(16, groups.attention).tolist() == list(range(16, 56))  # attention only: [T]


def vllm_mamba_layer(num_blocks, page_bytes, shapes, dtypes):
    """A Mamba layer's state tensors as vLLM's GPU model runner makes them (0.26,
    `_reshape_kv_cache_tensors`): views of one raw buffer, a page per block."""
    raw = torch.randint(-128, 127, (num_blocks * page_bytes,), dtype=torch.int8)
    out, offset = [], 0
    for shape, dtype in zip(shapes, dtypes):
        size = torch.tensor([], dtype=dtype).element_size()
        target = (num_blocks, *shape)
        stride = torch.empty(target).stride()
        out.append(
            torch.as_strided(
                raw.view(dtype), target, (page_bytes // size, *stride[1:]), offset // size
            )
        )
        offset += stride[0] * size
    return out


def test_a_mamba_layers_block_is_its_states_one_after_another_at_the_front_of_its_page():
    shapes, dtypes = ((3, 40), (4, 8, 16)), (torch.bfloat16, torch.float32)
    states = vllm_mamba_layer(6, 4096, shapes, dtypes)
    layers = state_layers({"m": states}, ["m"])
    assert layers.nbytes == 3 * 40 * 2 + 4 * 8 * 16 * 4
    block = layers.pages[0][4]
    want = torch.cat([s[4].contiguous().view(torch.uint8).flatten() for s in states])
    assert torch.equal(block, want)
    block.fill_(0)  # a load writes the states vLLM reads
    assert not states[0][4].any() and not states[1][4].any() and states[1][3].any()


def test_mamba_state_tensors_laid_out_otherwise_are_refused():
    states = vllm_mamba_layer(6, 4096, ((3, 40), (4, 8, 16)), (torch.bfloat16, torch.float32))
    with pytest.raises(UnsupportedModel, match="one after another"):
        state_layers({"m": [states[1], states[0]]}, ["m"])


def test_with_several_groups_a_disk_hit_is_promised_once_it_is_in_cpu_ram(tmp_path):
    """vLLM cannot recompute a failed load with several KV cache groups: the scheduler answers
    "not yet" (None) while the worker brings the hit up from disk, then promises it from CPU RAM."""

    from kvtier.engine import CacheEngine
    from kvtier.integrations.vllm.groups import KvGroups
    from kvtier.integrations.vllm.lookup import Handlers, LookupServer, socket_path
    from kvtier.integrations.vllm.scheduler import SchedulerSide
    from kvtier.integrations.vllm.spec import Shape
    from kvtier.integrations.vllm.worker import WorkerSide
    from kvtier.keys import KVFormat
    from kvtier.transfer import PagedKV

    config = KvtierConfig(
        save_unfull_chunk=False,
        chunk_size=16,
        max_local_cpu_size=1 / 1024,
        local_disk=str(tmp_path / "disk"),
        max_local_disk_size=0.01,
        blocking_timeout_secs=5,
    )
    layers = [torch.randn(2, 64, 16, 2, 32) for _ in range(2)]
    engine = CacheEngine(
        config, PagedKV.wrap(layers, "flash_attn"), KVFormat("m", "flash_attn", "float32")
    )
    toks = list(range(50))
    engine.store(toks, torch.arange(50))
    assert engine.flush(10)
    engine.tiers.cpu.clear()
    shape, groups = Shape(16, 16, False, 0), KvGroups((0, 1), (), {}, 16)
    worker = WorkerSide(config, shape, "several-groups", True, groups)
    worker.engine = engine  # what register_kv_caches builds from vLLM's tensors
    server = LookupServer(
        socket_path("several-groups", 0), Handlers(worker._find, worker._release, engine.clear)
    )
    scheduler = SchedulerSide(config, shape, "several-groups", 1, True, True, groups=groups)
    try:
        request = vllm_request("r", toks)
        assert scheduler.get_num_new_matched_tokens(request, 0) == (None, False)
        worker._coming_up["r"].result(timeout=10)
        # from CPU RAM, loaded at once
        assert scheduler.get_num_new_matched_tokens(request, 0) == (
            48,
            False,
        )
        assert engine.find(toks, cpu_only=True).tokens == 48
    finally:
        scheduler.close()
        server.close()
        worker.close()
