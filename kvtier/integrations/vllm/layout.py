"""The layout of vLLM's KV cache, read from what vLLM declares.

vLLM hands the connector one tensor per attention layer. What its
dimensions mean is the attention backend's to say, and it has said it two
ways:

    vLLM 0.26+ backends   `get_kv_cache_shape(num_blocks, block_size,
                          num_kv_heads, head_size)` names the logical shape,
                          `get_kv_cache_stride_order()` the order in memory
    vLLM 0.32+            every attention layer is a 4-D logical
                          [B, H, N, C] view (vLLM RFC #42082), its layer's
                          KV cache spec says what C holds

Either way the tensor kvtier receives has the logical shape and the
strides of memory. kvtier names each dimension (blocks, tokens, heads,
head, kv, or K|V packed in one dimension) by asking the backend for the
shape of made-up sizes, checks every size against the layer's spec and
the strides against the declared order, and views the tensor as the
canonical [K, NB, BS, NH, HS] (transfer/layout.py). Which half of a packed
content dimension is K is the backend's forward's to say: the GPU backends
in PACKED_KV split it `.split(head_size, dim=-1)`, K first. vLLM's CPU
backend gives the same shape another meaning (layout.py: vllm,
vllm-cpu-vec). Whatever kvtier cannot map exactly it refuses at start,
naming the backend and the layout: it never guesses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvtier.errors import UnsupportedKVLayout
from kvtier.logs import get_logger
from kvtier.transfer.layout import BLOCKS, HEAD, HEADS, KV, KV_HEAD, TOKENS, Dims, PagedKV

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = get_logger(__name__)

# Backends whose content dimension is K then V, head_size each (their forward:
# `key_cache, value_cache = kv_cache....split(head_size, dim=-1)`).
PACKED_KV = frozenset(
    {
        "FLASH_ATTN",
        "TRITON_ATTN",
        "FLASHINFER",
        "FLEX_ATTENTION",
        "ROCM_AITER_FA",
        "ROCM_AITER_UNIFIED_ATTN",
    }
)
CPU_BACKEND = "CPU_ATTN"

# Made-up sizes to name the dimensions of a declared shape by: none equals another,
# 2, or twice another (the block size is the real one: backends check it).
_PROBE_BLOCKS = 1_000_003
_PROBE_HEADS = (5, 7, 11, 13)
_PROBE_HEAD_SIZES = (88, 104, 120)


@dataclass(frozen=True)
class VllmKV:
    """vLLM's KV cache as kvtier moves it."""

    kv: PagedKV
    chunk_layout: str  # the chunk bytes' name in the chunk key (KVFormat.layout)
    whole_blocks: bool  # tokens inside a block lie the CPU kernel's way: move whole blocks only
    backend: str


@dataclass(frozen=True)
class LayerSpec:
    """What vLLM's KV cache spec says of one attention layer (per TP rank)."""

    block_size: int
    num_kv_heads: int
    head_size: int
    head_size_v: int
    mla: bool
    packed_content: (
        bool  # the spec declares content other than dense K/V (quantized with inline scales)
    )


def vllm_kv(vllm_config: VllmConfig, kv_caches: dict[str, Any], names: list[str]) -> VllmKV:
    """The KV tensors of `names` (in layer order) as kvtier's PagedKV; UnsupportedKVLayout
    when vLLM's layout cannot be mapped exactly."""
    layers = _attention_layers(vllm_config, names)
    backends = [layer.get_attn_backend() for layer in layers.values()]
    kinds = {b.get_name() for b in backends}
    if len(kinds) != 1:
        raise UnsupportedKVLayout(
            ", ".join(sorted(kinds)),
            "one attention backend for every layer",
            "layers with different attention backends (a hybrid model) are not moved yet",
        )
    name = kinds.pop()
    backend = backends[0]
    tensors = []
    for n in names:
        t = kv_caches[n]
        if not isinstance(t, torch.Tensor):
            raise UnsupportedKVLayout(
                name,
                f"{type(t).__name__} for layer {n}",
                "a KV cache that is one tensor per layer (not Mamba state)",
            )
        tensors.append(t)
    spec = _layer_spec(vllm_config, layers[names[0]])
    if name == CPU_BACKEND:
        return _cpu_kv(vllm_config, tensors, spec)
    kv = map_layout(backend, spec, vllm_config.cache_config.cache_dtype, tensors)
    return VllmKV(kv, "vllm-mla" if spec.mla else "kv", False, name)


def map_layout(
    backend: Any, spec: LayerSpec, cache_dtype: str, tensors: list[torch.Tensor]
) -> PagedKV:
    """A GPU backend's per-layer KV tensors as PagedKV, from what the backend declares."""
    name = backend.get_name()
    dims = declared_dims(backend, spec, cache_dtype, tensors[0])
    _check_sizes(name, dims, spec, tensors[0])
    _check_stride_order(name, backend, dims, tensors[0])
    kv = PagedKV.declared(tensors, dims, f"vllm {name}")
    log.info(
        "vLLM KV cache: backend %s, layout %s shape %s strides %s -> kvtier's "
        "[K, NB, BS, NH, HS] %s",
        name,
        _describe(dims),
        tuple(tensors[0].shape),
        tensors[0].stride(),
        tuple(kv.joined()[0].shape),
    )
    return kv


def declared_dims(backend: Any, spec: LayerSpec, cache_dtype: str, tensor: torch.Tensor) -> Dims:
    """The named dimensions of a layer's KV tensor, as its backend declares them."""
    name = backend.get_name()
    # vLLM < 0.32 declares the shape per backend
    shape_of = getattr(backend, "get_kv_cache_shape", None)
    if shape_of is not None:
        dims = _probe(name, shape_of, spec, cache_dtype)
    elif tensor.dim() == 4:  # vLLM 0.32+: [B, H, N, C] for every attention layer
        dims = (BLOCKS, HEADS, TOKENS, _content(name, spec, tensor.shape[3]))
    else:
        raise UnsupportedKVLayout(
            name,
            f"a {tensor.dim()}-D KV tensor {tuple(tensor.shape)}",
            "the 4-D [B, H, N, C] view vLLM 0.32+ gives every attention layer",
        )
    if KV_HEAD in dims and name not in PACKED_KV:
        raise UnsupportedKVLayout(
            name,
            _describe(dims),
            f"K and V packed in one dimension by a backend "
            f"known to put K first ({', '.join(sorted(PACKED_KV))})",
        )
    if spec.mla and (KV in dims or KV_HEAD in dims):
        raise UnsupportedKVLayout(
            name, _describe(dims), "one latent vector per token for an MLA model"
        )
    return dims


def _probe(name: str, shape_of: Any, spec: LayerSpec, cache_dtype: str) -> Dims:
    """Name the dimensions of the backend's declared shape by asking it for made-up sizes."""
    bs = spec.block_size
    heads = next(h for h in _PROBE_HEADS if h not in (bs, 2 * bs) and 2 * h != bs)
    hs = next(d for d in _PROBE_HEAD_SIZES if bs not in (d, 2 * d) and heads not in (d, 2 * d))
    try:
        shape = tuple(shape_of(_PROBE_BLOCKS, bs, heads, hs, cache_dtype_str=cache_dtype))
    except Exception as exc:  # noqa: BLE001 - any refusal of the backend's: say which, at start
        raise UnsupportedKVLayout(
            name, f"get_kv_cache_shape raised {exc!r}", "a declared KV shape"
        ) from exc
    names = {_PROBE_BLOCKS: BLOCKS, bs: TOKENS, hs: HEAD, 2 * hs: KV_HEAD, 2: KV}
    if not spec.mla:
        names[heads] = HEADS
    dims = tuple(names.get(size, f"?{size}") for size in shape)
    if any(d.startswith("?") for d in dims) or len(set(dims)) != len(dims):
        raise UnsupportedKVLayout(
            name,
            f"declared shape {shape} for (num_blocks={_PROBE_BLOCKS}, block_size={bs}, "
            f"num_kv_heads={heads}, head_size={hs}, cache_dtype={cache_dtype})",
            "dimensions of blocks, tokens, heads, head_size, K/V or K|V",
        )
    return dims


def _content(name: str, spec: LayerSpec, size: int) -> str:
    """What C of [B, H, N, C] holds (vLLM 0.32+)."""
    if spec.mla and size == spec.head_size:
        return HEAD
    if (
        not spec.mla
        and not spec.packed_content
        and spec.head_size == spec.head_size_v
        and size == 2 * spec.head_size
    ):
        return KV_HEAD
    raise UnsupportedKVLayout(
        name,
        f"[B, H, N, C] with C = {size} (head_size {spec.head_size}, "
        f"head_size_v {spec.head_size_v}, MLA {spec.mla})",
        "C = 2 * head_size (K|V), or head_size for MLA",
    )


def _check_sizes(name: str, dims: Dims, spec: LayerSpec, t: torch.Tensor) -> None:
    want = {
        TOKENS: spec.block_size,
        HEADS: spec.num_kv_heads,
        HEAD: spec.head_size,
        KV_HEAD: 2 * spec.head_size,
        KV: 2,
    }
    for dim, size in zip(dims, t.shape):
        if dim in want and size != want[dim]:
            raise UnsupportedKVLayout(
                name,
                f"{_describe(dims)} with shape {tuple(t.shape)}",
                f"{dim} = {want[dim]} as the layer's KV cache spec says",
            )


def _check_stride_order(name: str, backend: Any, dims: Dims, t: torch.Tensor) -> None:
    """The tensor's strides must lie in the order the backend declares (where it does):
    kvtier reads the strides, and a disagreement means a layout it does not understand."""
    order_of = getattr(backend, "get_kv_cache_stride_order", None)
    try:
        order = tuple(order_of()) if order_of is not None else None
    except NotImplementedError:  # vLLM: no stride order declared means memory follows the shape
        order = tuple(range(t.dim()))
    if order is None:
        return
    if sorted(order) != list(range(t.dim())):
        raise UnsupportedKVLayout(
            name, f"stride order {order} for shape {tuple(t.shape)}", "a permutation of its dims"
        )
    strides = [t.stride(i) for i in order if t.shape[i] > 1]
    if strides != sorted(strides, reverse=True) or t.stride(-1) != 1:
        raise UnsupportedKVLayout(
            name,
            f"{_describe(dims)} declared in memory order {order}, strides {t.stride()}",
            "strides that follow the declared order, innermost contiguous",
        )


def _cpu_kv(vllm_config: VllmConfig, tensors: list[torch.Tensor], spec: LayerSpec) -> VllmKV:
    """vLLM's CPU backend: [NB, NH, BS, 2*HS] whose halves per (block, head) are K and V,
    tokens laid out by its kernel. The "vec" kernel's is known per token; any other's is
    moved in whole blocks."""
    layout = "vllm" if spec.mla else cpu_kernel_layout(vllm_config)
    kv = PagedKV.wrap(tensors, layout, mla=spec.mla)
    return VllmKV(kv, "vllm-mla" if spec.mla else layout, layout == "vllm", CPU_BACKEND)


def cpu_kernel_layout(vllm_config: VllmConfig) -> str:
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(mc.dtype, cc.block_size, mc.get_head_size(), cc.cache_dtype)
    except Exception as exc:  # noqa: BLE001 - vLLM internals moved: whole blocks are always exact
        log.info("cannot tell vLLM's CPU attention kernel (%s): kvtier moves whole KV blocks", exc)
        return "vllm"
    return "vllm-cpu-vec" if isa == "vec" else "vllm"


def _attention_layers(vllm_config: VllmConfig, names: list[str]) -> dict[str, Any]:
    """vLLM's attention layer behind each KV tensor of `names`."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase, names)
    missing = [n for n in names if n not in layers]
    if missing:
        raise UnsupportedKVLayout(
            "?",
            f"KV caches of layers {missing[:3]} that are not attention layers",
            "an attention layer behind every KV cache tensor",
        )
    return layers


def _layer_spec(vllm_config: VllmConfig, layer: Any) -> LayerSpec:
    spec = layer.get_kv_cache_spec(vllm_config)
    mla = bool(vllm_config.model_config.use_mla)
    return LayerSpec(
        block_size=spec.block_size,
        num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_size,
        head_size_v=getattr(spec, "head_size_v", None) or spec.head_size,
        mla=mla,
        packed_content=getattr(spec, "state_content_bytes", None) is not None,
    )


def _describe(dims: Dims) -> str:
    short = {BLOCKS: "NB", TOKENS: "BS", HEADS: "NH", HEAD: "HS", KV: "2", KV_HEAD: "2*HS"}
    return "[" + ", ".join(short.get(d, d) for d in dims) + "]"
