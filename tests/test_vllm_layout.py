"""kvtier reads vLLM's KV layout from what vLLM declares, and refuses what it cannot map.

vLLM 0.32's own classes build the tensors here (its per-layer [B, H, N, C]
views over one buffer, in each of its memory layouts). vLLM 0.26's backends
declare their shape and stride order per backend; that vLLM cannot be
installed on this machine (its torch is not here), so the 0.26 declarations
are written out below as that release's FLASH_ATTN has them, and the real
0.26 runs on the GPU machine (scripts/gpu_vllm.sh).
"""

import importlib.util

import pytest
import torch

from kvtier.errors import UnsupportedKVLayout
from kvtier.integrations.vllm.layout import LayerSpec, map_layout
from kvtier.transfer.torch_copy import TorchTransfer

NB, BS, NH, HS, L = 6, 16, 4, 8, 3
SPEC = LayerSpec(
    block_size=BS, num_kv_heads=NH, head_size=HS, head_size_v=HS, mla=False, packed_content=False
)


def vllm_032_layers(layout_name: str) -> list[torch.Tensor]:
    """L layers' [B, H, N, C] views made by vLLM 0.32's create_kv_cache_views."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheTensor,
        compute_layout_strides,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    layout = KVCacheLayout[layout_name]
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=NH, head_size=HS, dtype=torch.float32)
    page = spec.page_size_bytes
    layer_stride, block_stride = compute_layout_strides(spec, NB, L, layout)[:2]
    raw = torch.zeros(NB * L * page, dtype=torch.int8)
    tensor = KVCacheTensor(
        size=raw.numel(),
        layers=[f"l{i}" for i in range(L)],
        layer_stride=layer_stride,
        block_stride=block_stride,
    )
    views = create_kv_cache_views(raw, spec, NB, layout, tensor)
    for v in views:
        v.copy_(torch.randn(v.shape))
    return views


class Vllm026FlashAttn:
    """What vLLM 0.26's FLASH_ATTN backend declares (vllm/v1/attention/backends/flash_attn.py)."""

    layout = "NHD"

    @staticmethod
    def get_name() -> str:
        return "FLASH_ATTN"

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
        if block_size % 16:
            raise ValueError("Block size must be a multiple of 16.")
        return (num_blocks, num_kv_heads, block_size, 2 * head_size)

    @classmethod
    def get_kv_cache_stride_order(cls, include_num_layers_dimension=False):
        return (0, 2, 1, 3) if cls.layout == "NHD" else (0, 1, 2, 3)


def vllm_026_layers(backend) -> list[torch.Tensor]:
    """As vLLM 0.26's model runner makes them: memory in stride order, seen in the logical shape."""
    shape = backend.get_kv_cache_shape(NB, BS, NH, HS)
    order = backend.get_kv_cache_stride_order()
    inverse = [order.index(i) for i in range(len(order))]
    return [torch.randn([shape[i] for i in order]).permute(*inverse) for _ in range(L)]


def packed_reference(layer: torch.Tensor, slot: int) -> torch.Tensor:
    """[2, NH, HS] of one token, as the backends' forward reads it: K = C[:HS], V = C[HS:]."""
    b, o = divmod(slot, BS)
    return torch.stack([layer[b, :, o, :HS], layer[b, :, o, HS:]])


def check_moves_the_right_bytes(layers: list[torch.Tensor], backend) -> None:
    kv = map_layout(backend, SPEC, "auto", layers)
    perm = torch.randperm(NB * BS)
    slots, dst = perm[:21], perm[21:42]
    chunks = [torch.empty(kv.chunk_shape(n)) for n in (8, 8, 5)]
    TorchTransfer(kv).gather(slots, chunks)
    flat = torch.cat(chunks, dim=2)
    for li, layer in enumerate(layers):
        for t, s in enumerate(slots.tolist()):
            assert torch.equal(flat[li, :, t], packed_reference(layer, s))
    TorchTransfer(kv).scatter(dst, chunks)
    for layer in layers:
        for a, b in zip(slots.tolist(), dst.tolist()):
            assert torch.equal(packed_reference(layer, a), packed_reference(layer, b))


VLLM_032 = importlib.util.find_spec("vllm.v1.kv_cache_layout") is not None


@pytest.mark.skipif(not VLLM_032, reason="vLLM < 0.32: no [B, H, N, C] views of its own")
@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC", "BLNHC", "BLHNC", "LHBNC", "BHLNC"])
def test_vllm_032_views_in_every_memory_layout_move_the_bytes_attention_reads(layout):
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    check_moves_the_right_bytes(vllm_032_layers(layout), FlashAttentionBackend)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_vllm_026_declared_shape_and_stride_order_move_the_bytes_attention_reads(layout):
    backend = type("FlashAttn", (Vllm026FlashAttn,), {"layout": layout})
    check_moves_the_right_bytes(vllm_026_layers(backend), backend)


def test_the_installed_vllms_flash_attn_backend_moves_the_bytes_attention_reads():
    """vLLM 0.26 (the GPU machine) declares its shape; 0.32 (here) gives [B, H, N, C] views."""
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    if not hasattr(FlashAttentionBackend, "get_kv_cache_shape"):
        check_moves_the_right_bytes(vllm_032_layers("LBNHC"), FlashAttentionBackend)
        return
    from vllm.config import VllmConfig, set_current_vllm_config

    # its stride order reads the configured cache layout
    with set_current_vllm_config(VllmConfig()):
        check_moves_the_right_bytes(vllm_026_layers(FlashAttentionBackend), FlashAttentionBackend)


def test_a_packed_layout_of_a_backend_not_known_to_put_k_first_is_refused():
    other = type("Other", (Vllm026FlashAttn,), {"get_name": staticmethod(lambda: "SOME_NEW_ATTN")})
    with pytest.raises(UnsupportedKVLayout, match="SOME_NEW_ATTN.*K first"):
        map_layout(other, SPEC, "auto", vllm_026_layers(Vllm026FlashAttn))


def test_a_declared_shape_with_a_dimension_kvtier_cannot_name_is_refused():
    # FLASHINFER's nvfp4 cache: (num_blocks, 2 * num_kv_heads, block_size, full_dim).
    nvfp4 = type(
        "Nvfp4",
        (Vllm026FlashAttn,),
        {
            "get_name": staticmethod(lambda: "FLASHINFER"),
            "get_kv_cache_shape": staticmethod(
                lambda nb, bs, nh, hs, cache_dtype_str="auto": (nb, 2 * nh, bs, hs // 2 + 8)
            ),
        },
    )
    with pytest.raises(UnsupportedKVLayout, match="FLASHINFER: declared shape"):
        map_layout(nvfp4, SPEC, "nvfp4", vllm_026_layers(Vllm026FlashAttn))


def test_strides_that_disagree_with_the_declared_order_are_refused():
    hnd = type("FlashAttn", (Vllm026FlashAttn,), {"layout": "HND"})
    with pytest.raises(UnsupportedKVLayout, match="declared in memory order"):
        map_layout(hnd, SPEC, "auto", vllm_026_layers(Vllm026FlashAttn))  # NHD memory, HND declared


def test_sizes_that_disagree_with_the_layer_spec_are_refused():
    wrong = LayerSpec(
        block_size=BS,
        num_kv_heads=NH * 2,
        head_size=HS,
        head_size_v=HS,
        mla=False,
        packed_content=False,
    )
    with pytest.raises(UnsupportedKVLayout, match="heads = 8"):
        map_layout(Vllm026FlashAttn, wrong, "auto", vllm_026_layers(Vllm026FlashAttn))


def test_mla_one_latent_vector_per_token():
    mla = type(
        "Mla",
        (),
        {
            "get_name": staticmethod(lambda: "FLASHMLA"),
            "get_kv_cache_shape": staticmethod(
                lambda nb, bs, nh, hs, cache_dtype_str="auto": (nb, bs, hs)
            ),
        },
    )
    spec = LayerSpec(
        block_size=BS,
        num_kv_heads=1,
        head_size=576,
        head_size_v=576,
        mla=True,
        packed_content=False,
    )
    layers = [torch.randn(NB, BS, 576) for _ in range(L)]
    kv = map_layout(mla, spec, "auto", layers)
    assert (kv.kv, kv.heads, kv.head_size) == (1, 1, 576)
    assert torch.equal(kv.layers[1][0, 2, 5, 0], layers[1][2, 5])


def test_a_sliding_window_groups_null_blocks_are_slots_kvtier_skips():
    """vLLM pads a sliding window's skipped tokens with its null block (block 0): those are
    -1 in that group's row of the slot table (neither read nor written there)."""
    from kvtier.integrations.vllm.spec import TransferSpec

    spec = TransferSpec("r", list(range(40)), [[5, 6, 7], [0, 0, 9]], 0, 40)
    slots = spec.slots(16)
    assert slots.shape == (2, 40)
    assert slots[0].tolist() == list(range(80, 120)) and slots[1, :32].eq(-1).all()
    assert slots[1, 32:].tolist() == list(range(144, 152))
    assert spec.blocks_of(1, 2) == {6, 7, 9}
    one = TransferSpec("r", list(range(20)), [[3, 4]], 0, 20)
    assert one.slots(16).tolist() == list(range(48, 68))
