"""The Triton kernels of the GPU transfer (triton_copy.py): one program per
token and layer-and-K/V moves a token's values between a KV page and a chunk,
reached through tables of base addresses; a digest kernel sums KV digests as
chunks cross (codec.kv_digest); a kernel reads the slot table out of pinned
memory (a copy-engine copy would queue behind the chunks)."""

from __future__ import annotations

import triton
import triton.language as tl

DIGEST_BLOCK = 4096  # words per program of digest_kernel
SLOT_BLOCK = 1024  # slot-table words per program of host_words_kernel

# Triton compiles a kernel again for each new "specialization" of its integer and pointer
# arguments (a value of 1, one divisible by 16, a 16-byte-aligned address). Arguments that
# change with the request (token and chunk counts, slot tables, host addresses) are left
# unspecialized, so that the kernels compiled at the engine's start serve every request:
# on an H100 inside vLLM a request's first store of two chunks took 249 ms, its first
# partial load 134 ms, each compiling a variant (2026-11-26, serving workload).
PER_REQUEST = (
    "slots",
    "S",
    "chunk_ptrs",
    "T",
    "table",
    "out",
    "n",
    "src",
    "dst",
    "table_addr",
    "runs",
)


def _jit(fn):
    """triton.jit with the kernel's per-request arguments unspecialized."""
    args = fn.__code__.co_varnames[: fn.__code__.co_argcount]
    return triton.jit(do_not_specialize=[a for a in args if a in PER_REQUEST])(fn)


@triton.jit
def token_addresses(
    layer0_ptr,
    layer_ptrs,
    slot_rows,
    chunk_ptrs,
    slots,
    S,
    T,
    C,
    s_k,
    s_b,
    s_n,
    BS,
    K: tl.constexpr,
    GROUPED: tl.constexpr,
):
    """Program (t, l*K + k) of the copy kernels: the page of token t's K-or-V k in layer l,
    its chunk's base address (int64), its row in the chunk (layer l, k, its place in the
    chunk), and whether the token moves at all (slot -1: a token of a cut chunk that stays,
    or one whose page a sliding-window layer no longer keeps). Layer l's slots are row
    slot_rows[l] of the slot table (vLLM's KV cache groups: each its own blocks), rows S
    apart. Without GROUPED (one row) the row is not read: a load that waits on another
    load costs every program its latency."""
    t = tl.program_id(0).to(tl.int64)
    lk = tl.program_id(1).to(tl.int64)
    layer = lk // K
    k = lk % K
    if GROUPED:
        slot = tl.load(slots + tl.load(slot_rows + layer).to(tl.int64) * S + t).to(tl.int64)
    else:
        slot = tl.load(slots + t).to(tl.int64)
    here = slot >= 0
    slot = tl.maximum(slot, 0)
    c = t // C
    tt = t - c * C
    n_c = tl.minimum(C, T - c * C)
    page = tl.load(layer_ptrs + layer).to(tl.pointer_type(layer0_ptr.dtype.element_ty))
    page += k * s_k + (slot // BS) * s_b + (slot % BS) * s_n
    return page, tl.load(chunk_ptrs + c), lk * n_c + tt, here


@_jit
def kv_copy_kernel(
    layer0_ptr,  # typed pointer to layer 0: gives the element type
    layer_ptrs,  # int64[L]: base address of each layer's canonical view
    slot_rows,  # int32[L]: each layer's row of the slot table
    chunk_ptrs,  # int64[num_chunks]: base address of each chunk [L, K, n_c, H, D]
    slots,  # int64[rows, >= T]; -1: skip this token (in that row's layers)
    S,  # elements between rows of `slots` (0: one row)
    T,
    C,  # full chunk size in tokens
    s_k,
    s_b,
    s_n,
    s_h,  # element strides of the canonical view
    BS,
    W: tl.constexpr,  # H * D
    D: tl.constexpr,
    K: tl.constexpr,
    TO_CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    GROUPED: tl.constexpr,  # slots has a row per KV cache group (slot_rows read); else one row
):
    page, chunk, row, here = token_addresses(
        layer0_ptr, layer_ptrs, slot_rows, chunk_ptrs, slots, S, T, C, s_k, s_b, s_n, BS, K, GROUPED
    )
    width = tl.where(here, W, 0)
    chunk = chunk.to(tl.pointer_type(layer0_ptr.dtype.element_ty)) + row * W
    for w0 in range(0, W, BLOCK):
        w = w0 + tl.arange(0, BLOCK)
        mask = w < width
        src_off = (w // D) * s_h + (w % D)
        if TO_CHUNK:
            tl.store(chunk + w, tl.load(page + src_off, mask=mask), mask=mask)
        else:
            tl.store(page + src_off, tl.load(chunk + w, mask=mask), mask=mask)


@_jit
def kv_quant_copy_kernel(
    layer0_ptr,
    layer_ptrs,
    slot_rows,
    chunk_ptrs,
    slots,
    S,
    T,
    C,
    s_k,
    s_b,
    s_n,
    s_h,
    BS,  # as in kv_copy_kernel
    NH: tl.constexpr,
    D: tl.constexpr,
    NHP: tl.constexpr,  # NH and D rounded up to powers of two: the tile of one token's heads
    DP: tl.constexpr,
    K: tl.constexpr,
    TO_CHUNK: tl.constexpr,  # True: quantize page -> chunk row; False: dequantize chunk row -> page
    FP8: tl.constexpr,
    QMAX: tl.constexpr,
    GROUPED: tl.constexpr,
):
    """Program (t, l*K + k): token t's row of layer l, K-or-V k, in a quantized
    chunk (quant.py): NH*D one-byte values, then NH float32 scales."""
    page, chunk, r, here = token_addresses(
        layer0_ptr, layer_ptrs, slot_rows, chunk_ptrs, slots, S, T, C, s_k, s_b, s_n, BS, K, GROUPED
    )
    heads_here = tl.where(here, NH, 0)
    elem_ty = layer0_ptr.dtype.element_ty
    row = chunk.to(tl.pointer_type(tl.uint8)) + r * (NH * D + 4 * NH)
    scales = (row + NH * D).to(tl.pointer_type(tl.float32))
    heads = tl.arange(0, NHP)
    h = heads[:, None]
    d = tl.arange(0, DP)[None, :]
    mask = (h < heads_here) & (d < D)
    head_mask = heads < heads_here
    if TO_CHUNK:
        x = tl.load(page + h * s_h + d, mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=1)
        inv = tl.where(amax > 0, QMAX / amax, 0.0)
        y = tl.minimum(tl.maximum(x * inv[:, None], -QMAX), QMAX)
        if FP8:
            q = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:
            q = tl.floor(y + 0.5).to(tl.int8).to(tl.uint8, bitcast=True)
        tl.store(row + h * D + d, q, mask=mask)
        tl.store(scales + heads, amax / QMAX, mask=head_mask)
    else:
        q = tl.load(row + h * D + d, mask=mask, other=0)
        if FP8:
            v = q.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            v = q.to(tl.int8, bitcast=True).to(tl.float32)
        s = tl.load(scales + heads, mask=head_mask, other=0.0)
        tl.store(page + h * s_h + d, (v * s[:, None]).to(elem_ty), mask=mask)


@_jit
def kv_int4_copy_kernel(
    layer0_ptr,
    layer_ptrs,
    slot_rows,
    chunk_ptrs,
    slots,
    S,
    T,
    C,
    s_k,
    s_b,
    s_n,
    s_h,
    BS,  # as in kv_copy_kernel
    NH: tl.constexpr,
    D: tl.constexpr,
    NHP: tl.constexpr,  # NH rounded up to a power of two
    G: tl.constexpr,  # values a scale covers (a power of two dividing D)
    NG: tl.constexpr,  # D // G
    NGP: tl.constexpr,  # NG rounded up to a power of two
    ROW: tl.constexpr,  # bytes of a row (quant.py's row_bytes)
    K: tl.constexpr,
    TO_CHUNK: tl.constexpr,  # True: quantize page -> chunk row; False: dequantize chunk row -> page
    GROUPED: tl.constexpr,
):
    """Program (t, l*K + k): token t's row of layer l, K-or-V k, in an int4 chunk (quant.py):
    NH*D/2 bytes of two values each, value e of a group in the low nibble and value
    e + G/2 in the high one, then a float16 scale per (head, group)."""
    page, chunk, r, here = token_addresses(
        layer0_ptr, layer_ptrs, slot_rows, chunk_ptrs, slots, S, T, C, s_k, s_b, s_n, BS, K, GROUPED
    )
    heads_here = tl.where(here, NH, 0)
    elem_ty = layer0_ptr.dtype.element_ty
    row = chunk.to(tl.pointer_type(tl.uint8)) + r * ROW
    scales = (row + NH * D // 2).to(tl.pointer_type(tl.float16))
    h = tl.arange(0, NHP)[:, None]
    g = tl.arange(0, NGP)[None, :]
    e = tl.arange(0, G // 2)[None, None, :]
    hg_mask = (h < heads_here) & (g < NG)
    mask = hg_mask[:, :, None]
    lo_off = (h * s_h + g * G)[:, :, None] + e
    byte_off = (h * (D // 2) + g * (G // 2))[:, :, None] + e
    if TO_CHUNK:
        lo = tl.load(page + lo_off, mask=mask, other=0.0).to(tl.float32)
        hi = tl.load(page + lo_off + G // 2, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(lo), axis=2), tl.max(tl.abs(hi), axis=2))
        scale = tl.minimum(amax / 7.0, 65504.0).to(tl.float16)
        s = scale.to(tl.float32)
        inv = tl.where(s > 0, 1.0 / s, 0.0)[:, :, None]
        q_lo = tl.floor(tl.minimum(tl.maximum(lo * inv, -7.0), 7.0) + 0.5).to(tl.int32) & 15
        q_hi = tl.floor(tl.minimum(tl.maximum(hi * inv, -7.0), 7.0) + 0.5).to(tl.int32) & 15
        tl.store(row + byte_off, (q_lo | (q_hi << 4)).to(tl.uint8), mask=mask)
        tl.store(scales + h * NG + g, scale, mask=hg_mask)
        pad = NH * D // 2 + 2 * NH * NG + tl.arange(0, 4)  # to the row's word: zeros, as in torch
        tl.store(row + pad, tl.zeros((4,), dtype=tl.uint8), mask=pad < tl.where(here, ROW, 0))
    else:
        b = tl.load(row + byte_off, mask=mask, other=0).to(tl.int32)
        q_lo = b & 15
        q_hi = b >> 4
        s = tl.load(scales + h * NG + g, mask=hg_mask, other=0.0).to(tl.float32)[:, :, None]
        lo = (q_lo - ((q_lo & 8) << 1)).to(tl.float32) * s
        hi = (q_hi - ((q_hi & 8) << 1)).to(tl.float32) * s
        tl.store(page + lo_off, lo.to(elem_ty), mask=mask)
        tl.store(page + lo_off + G // 2, hi.to(elem_ty), mask=mask)


@_jit
def digest_kernel(
    # int64[rows, 3]: per slice its address, its bytes, and the index of its first word in its
    # chunk
    table,
    out,  # int64[n]: slice c's share of its chunk's digest is added to out[c % n] (mod 2^64)
    n,  # chunks: the table holds one slice of each, or of each for several layers in turn
    A: tl.constexpr,
    B: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """codec.kv_digest of slices: program (c, b) sums words [b*BLOCK, (b+1)*BLOCK) of slice c."""
    c = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1).to(tl.int64) * BLOCK
    words = tl.load(table + c * 3 + 1) // 4
    if start < words:
        base = tl.load(table + c * 3).to(tl.pointer_type(tl.uint32))
        first = tl.load(table + c * 3 + 2)
        idx = start + tl.arange(0, BLOCK).to(tl.int64)
        mask = idx < words
        w = tl.load(base + idx, mask=mask, other=0).to(tl.int64)  # zero-extended
        weight = ((first + idx) * A + B) | 1  # int64 arithmetic wraps: the same bits as the u64 sum
        tl.atomic_add(out + c % n, tl.sum(tl.where(mask, (w + 1) * weight, 0), axis=0))


@_jit
def host_words_kernel(src, dst, n, BLOCK: tl.constexpr):
    """dst[i] = src[i], int64 words, `src` the address of pinned host memory: the kernel
    reads it over PCIe, where a copy-engine copy would queue behind chunks already crossing."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    tl.store(dst + i, tl.load(src.to(tl.pointer_type(tl.int64)) + i, mask=mask), mask=mask)


@_jit
def host_runs_kernel(table_addr, runs, BLOCK: tl.constexpr):
    """Copy `runs` runs of rows between pinned host memory and the device, either way, by
    the SMs' own loads and stores over PCIe, with no copy engine (whose queue vLLM's small
    input copies would wait behind: every request's next step stalled by a bulk load).
    table[r] = (source, destination, source pitch, destination pitch, int64 words per row,
    rows), addresses and pitches in bytes; the table itself at `table_addr`, pinned host
    memory read in place. Persistent: the grid's few programs stride over every (run, row,
    block), leaving the other SMs to the forward that runs beside the copy."""
    table = table_addr.to(tl.pointer_type(tl.int64))
    pid = tl.program_id(0).to(tl.int64)
    programs = tl.num_programs(0).to(tl.int64)
    for r in range(runs):
        src0 = tl.load(table + r * 6)
        dst0 = tl.load(table + r * 6 + 1)
        src_pitch = tl.load(table + r * 6 + 2)
        dst_pitch = tl.load(table + r * 6 + 3)
        words = tl.load(table + r * 6 + 4)
        rows = tl.load(table + r * 6 + 5)
        blocks = (words + BLOCK - 1) // BLOCK
        for w in range(pid, rows * blocks, programs):
            row = w // blocks
            off = (w - row * blocks) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
            mask = off < words
            src = (src0 + row * src_pitch).to(tl.pointer_type(tl.int64))
            dst = (dst0 + row * dst_pitch).to(tl.pointer_type(tl.int64))
            tl.store(dst + off, tl.load(src + off, mask=mask), mask=mask)
