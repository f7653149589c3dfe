import os
import subprocess
import sys

import pytest
import torch

from kvtier.transfer import PagedKV
from kvtier.transfer.factory import make_transfer
from kvtier.transfer.torch_copy import TorchTransfer

L, NB, BS, H, D = 3, 12, 4, 2, 8
SHAPES = {
    "flash_attn": (2, NB, BS, H, D),
    "flashinfer": (NB, 2, BS, H, D),
    "mla": (NB, BS, D),
    "vllm": (NB, H, BS, 2 * D),
    "vllm-cpu-vec": (NB, H, BS, 2 * D),
    "packed": (NB, H, BS, 2 * D),
}


def reference_tokens(layer: torch.Tensor, layout: str, slot: int) -> torch.Tensor:
    """[K, H, D] of one token, read straight from the engine's layout."""
    b, o = divmod(slot, BS)
    if layout == "flash_attn":
        return layer[:, b, o]
    if layout == "flashinfer":
        return layer[b, :, o]
    if layout == "mla":
        return layer[b, o][None, None]
    if layout == "packed":  # vLLM's GPU backends: K|V in the last dimension, K first
        return layer[b, :, o].reshape(H, 2, D).permute(1, 0, 2)
    halves = layer.reshape(NB, H, 2, BS * D)[b]  # per (block, head): all K, then all V
    if layout == "vllm":
        return halves.reshape(H, 2, BS, D)[:, :, o].permute(1, 0, 2)
    k = halves[:, 0].reshape(H, D, BS)[:, :, o]  # vllm-cpu-vec: K transposed, V by token
    v = halves[:, 1].reshape(H, BS, D)[:, o]
    return torch.stack([k, v])


@pytest.mark.parametrize("layout", SHAPES)
def test_torch_gather_matches_layout_reference(layout):
    torch.manual_seed(0)
    layers = [torch.randn(SHAPES[layout]) for _ in range(L)]
    kv = PagedKV.wrap(layers, layout)
    slots = torch.randperm(NB * BS)[:10]
    chunks = [torch.empty(kv.chunk_shape(n)) for n in (4, 4, 2)]
    TorchTransfer(kv).gather(slots, chunks)
    flat = torch.cat(chunks, dim=2)  # [L, K, T, H, D]
    for li, layer in enumerate(layers):
        for t, s in enumerate(slots.tolist()):
            assert torch.equal(flat[li, :, t], reference_tokens(layer, layout, s))


@pytest.mark.parametrize("layout", SHAPES)
def test_torch_scatter_roundtrip(layout):
    layers = [torch.randn(SHAPES[layout]) for _ in range(L)]
    kv = PagedKV.wrap(layers, layout)
    perm = torch.randperm(NB * BS)
    src, dst = perm[:9], perm[9:18]
    chunks = [torch.empty(kv.chunk_shape(n)) for n in (4, 4, 1)]
    t = TorchTransfer(kv)
    t.gather(src, chunks)
    t.scatter(dst, chunks)
    for layer in layers:
        for a, b in zip(src.tolist(), dst.tolist()):
            assert torch.equal(
                reference_tokens(layer, layout, a), reference_tokens(layer, layout, b)
            )


def test_torch_layerwise_gather_moves_each_layer_when_saved():
    layers = [torch.randn(SHAPES["flash_attn"]) for _ in range(L)]
    kv = PagedKV.wrap(layers, "flash_attn")
    slots = torch.randperm(NB * BS)[:7]
    ref = [torch.empty(kv.chunk_shape(n)) for n in (4, 3)]
    TorchTransfer(kv).gather(slots, ref)
    got = [torch.zeros(kv.chunk_shape(n)) for n in (4, 3)]
    saves = TorchTransfer(kv).gather_layerwise(slots, got)
    saves.save(2)
    assert all(torch.equal(g[2], r[2]) and not g[:2].any() for g, r in zip(got, ref))
    assert saves.unsaved() == [0, 1]
    saves.save(0), saves.save(1)
    saves.finish()
    assert all(torch.equal(g, r) for g, r in zip(got, ref))


def test_torch_scatter_skips_slot_minus_one():
    layers = [torch.randn(SHAPES["flash_attn"]) for _ in range(L)]
    kv = PagedKV.wrap(layers, "flash_attn")
    chunk = torch.randn(kv.chunk_shape(4))
    before = [x.clone() for x in layers]
    TorchTransfer(kv).scatter(torch.tensor([-1, 5, -1, 9]), [chunk])
    for i, (layer, old) in enumerate(zip(layers, before)):
        assert torch.equal(layer[:, 5 // BS, 5 % BS], chunk[i, :, 1])
        assert torch.equal(layer[:, 9 // BS, 9 % BS], chunk[i, :, 3])
        layer[:, 5 // BS, 5 % BS] = old[:, 5 // BS, 5 % BS]
        layer[:, 9 // BS, 9 % BS] = old[:, 9 // BS, 9 % BS]
        assert torch.equal(layer, old)  # nothing else was written


def test_vllm_cpu_layouts_refuse_a_non_contiguous_cache():
    # vLLM's CPU attention views its cache as [NB, NH, 2*BS, C/2], which needs it contiguous.
    layer = torch.randn(NB, BS, H, 2 * D).permute(0, 2, 1, 3)
    for layout in ("vllm", "vllm-cpu-vec"):
        with pytest.raises(ValueError, match="contiguous"):
            PagedKV.wrap([layer], layout)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kvtier_reads_each_token_where_vllms_cpu_kernel_writes_it(dtype):
    """vLLM's own cache-write op fills a cache; kvtier's layout for the kernel that
    vLLM picks here must find every token, also in a partly filled block."""
    pytest.importorskip("vllm")
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    if not hasattr(torch.ops._C, "cpu_attn_reshape_and_cache"):  # loaded with vllm._custom_ops
        pytest.skip("vLLM's CPU ops are not in this build (a CUDA build of vLLM)")

    nb, nh, bs, hs, n = 4, 2, 128, 64, 300  # 300 tokens: the third block is partly filled
    isa = _get_attn_isa(dtype, bs, hs)
    layout = "vllm-cpu-vec" if isa == "vec" else "vllm"
    if layout == "vllm":
        pytest.skip(f"vLLM picks the {isa} kernel here: kvtier moves whole blocks of it")
    cache = torch.zeros(nb, nh, bs, 2 * hs, dtype=dtype)
    key_cache, value_cache = cache.view(nb, nh, 2 * bs, hs).chunk(2, dim=2)
    key, value = torch.randn(n, nh, hs, dtype=dtype), torch.randn(n, nh, hs, dtype=dtype)
    slots = torch.randperm(nb * bs)[:n]
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)
    kv = PagedKV.wrap([cache], layout)
    chunk = torch.empty(kv.chunk_shape(n), dtype=dtype)
    TorchTransfer(kv).gather(slots, [chunk])
    assert torch.equal(chunk[0, 0], key) and torch.equal(chunk[0, 1], value)
    # and a scatter of a few tokens lands where vLLM's kernel reads them
    fresh = torch.zeros_like(cache)
    TorchTransfer(PagedKV.wrap([fresh], layout)).scatter(slots[:37], [chunk[:, :, :37]])
    k2, v2 = fresh.view(nb, nh, 2 * bs, hs).chunk(2, dim=2)
    again = torch.zeros_like(cache)
    k3, v3 = again.view(nb, nh, 2 * bs, hs).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key[:37], value[:37], k3, v3, slots[:37], isa)
    assert torch.equal(fresh, again)


def test_layout_validation():
    with pytest.raises(ValueError, match="5-D"):
        PagedKV.wrap([torch.zeros(2, 3)], "flash_attn")
    with pytest.raises(ValueError, match="unknown KV layout"):
        PagedKV.wrap([torch.zeros(2, 3)], "paged")
    with pytest.raises(ValueError, match="share shape"):
        PagedKV.wrap([torch.zeros(SHAPES["mla"]), torch.zeros(NB + 1, BS, D)], "mla")


def test_triton_needs_cuda_or_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    kv = PagedKV.wrap([torch.zeros(SHAPES["mla"])], "mla")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        make_transfer(kv, "triton")


TRITON_CHECK = r"""
import torch
from kvtier.transfer import PagedKV
from kvtier.transfer.torch_copy import TorchTransfer
from kvtier.transfer.triton_copy import TritonTransfer
shapes = %r
torch.manual_seed(0)
for layout, shape in shapes.items():
    for dtype in (torch.float32, torch.bfloat16):
        layers = [torch.randn(shape).to(dtype) for _ in range(3)]
        kv = PagedKV.wrap(layers, layout)
        slots = torch.randperm(kv.num_slots)[:11]
        sizes = (4, 4, 3)
        ref = [torch.empty(kv.chunk_shape(n), dtype=dtype) for n in sizes]
        got = [torch.empty(kv.chunk_shape(n), dtype=dtype) for n in sizes]
        TorchTransfer(kv).gather(slots, ref)
        TritonTransfer(kv).gather(slots, got)
        assert all(torch.equal(a, b) for a, b in zip(ref, got)), (layout, dtype, "gather")
        # addressed (a PD sender's ring): each chunk's bytes where its address says, out of order,
        # launched a group at a time from tables that went up once
        nbytes = [r.numel() * r.element_size() for r in ref]
        at = [nbytes[2], nbytes[2] + nbytes[0], 0]
        buf = torch.zeros(sum(nbytes) + 8, dtype=torch.uint8)
        launch = TritonTransfer(kv).gather_addressed(
            slots, [buf.data_ptr() + a for a in at], sizes[0]
        ).launch
        launch(2, 3)
        assert buf[: nbytes[2]].any() and not buf[nbytes[2] :].any(), (
            layout,
            "one group, its chunk only",
        )
        launch(0, 2)
        for a, n, r in zip(at, nbytes, ref):
            assert torch.equal(buf[a : a + n].view(dtype).view(r.shape), r), (
                layout,
                dtype,
                "addressed gather",
            )
        assert not buf[-8:].any()
        dst = [torch.zeros_like(t) for t in layers]
        kv2 = PagedKV.wrap(dst, layout)
        TritonTransfer(kv2).scatter(slots, got)
        back = [torch.empty(kv.chunk_shape(n), dtype=dtype) for n in sizes]
        TorchTransfer(kv2).gather(slots, back)
        assert all(torch.equal(a, b) for a, b in zip(ref, back)), (layout, dtype, "scatter")
        untouched = torch.ones(kv2.num_slots, dtype=torch.bool); untouched[slots] = False
        z = torch.empty(kv.chunk_shape(int(untouched.sum())), dtype=dtype)
        TorchTransfer(kv2).gather(untouched.nonzero().flatten(), [z])
        assert not z.any(), (layout, "scatter wrote outside its slots")
        dst3 = [torch.zeros_like(t) for t in layers]
        kv3 = PagedKV.wrap(dst3, layout)
        handle = TritonTransfer(kv3).scatter_layerwise(slots, got)
        handle.wait(1)  # layers 0 and 1 written, layer 2 not yet
        assert dst3[1].any() and not dst3[2].any(), (layout, "layerwise order")
        handle.finish()
        back = [torch.empty(kv.chunk_shape(n), dtype=dtype) for n in sizes]
        TorchTransfer(kv3).gather(slots, back)
        assert all(torch.equal(a, b) for a, b in zip(ref, back)), (
            layout,
            dtype,
            "layerwise scatter",
        )
        holes = slots.clone()
        holes[::3] = -1  # tokens of cut chunks: not written anywhere
        a_dst, b_dst = [torch.zeros_like(t) for t in layers], [torch.zeros_like(t) for t in layers]
        TritonTransfer(PagedKV.wrap(a_dst, layout)).scatter(holes, got)
        TorchTransfer(PagedKV.wrap(b_dst, layout)).scatter(holes, got)
        assert all(torch.equal(a, b) for a, b in zip(a_dst, b_dst)), (layout, "skipped slots")
        assert sum(int((a != 0).any(dim=-1).sum()) for a in a_dst) > 0
        saved = [torch.zeros(kv.chunk_shape(n), dtype=dtype) for n in sizes]
        saves = TritonTransfer(kv).gather_layerwise(slots, saved)
        saves.save(1)  # only layer 1 moves
        assert all(
            torch.equal(a[1], b[1]) and not a[0].any() and not a[2].any()
            for a, b in zip(saved, ref)
        ), (layout, "layerwise gather order")
        saves.save(0), saves.save(2)
        saves.finish()
        assert not saves.unsaved()
        assert all(torch.equal(a, b) for a, b in zip(ref, saved)), (
            layout,
            dtype,
            "layerwise gather",
        )
print("ok")
"""


def test_triton_kernels_in_interpreter_match_torch():
    """The GPU kernels, run by Triton's CPU interpreter on small shapes."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    gpu_layouts = {k: v for k, v in SHAPES.items() if k != "vllm-cpu-vec"}  # a CPU-only layout
    out = subprocess.run(
        [sys.executable, "-c", TRITON_CHECK % gpu_layouts],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "ok"


GROUPED_CHECK = """
import torch
from kvtier.transfer import PagedKV
from kvtier.transfer.torch_copy import TorchTransfer
from kvtier.transfer.triton_copy import TritonTransfer
torch.manual_seed(0)
layers = [torch.randn(2, 8, 4, 2, 16) for _ in range(3)]
kv = PagedKV.wrap(layers, "flash_attn").grouped([0, 1, 0])
slots = torch.stack([torch.randperm(32)[:11], torch.randperm(32)[:11]])
slots[1, :3] = -1  # pages the second group (layer 1) no longer keeps
sizes = (4, 4, 3)
def at(layer, s):  # [K, T, H, D]
    return layers[layer][:, s // 4, s % 4]
for T in (TorchTransfer, TritonTransfer):
    got = [torch.zeros(kv.chunk_shape(n)) for n in sizes]
    T(kv).gather(slots, got)
    whole = torch.cat(got, dim=2)  # [L, K, 11, H, D]
    assert torch.equal(whole[0], at(0, slots[0])) and torch.equal(
        whole[2], at(2, slots[0])
    ), T.__name__
    assert torch.equal(whole[1][:, 3:], at(1, slots[1, 3:])), T.__name__  # its -1 tokens: anything
    if T is TritonTransfer:  # addressed, a group of chunks a launch, over a slice of the table
        buf = torch.zeros(sum(c.numel() for c in got))
        per = [c.numel() for c in got]
        launch = T(kv).gather_addressed(
            slots, [buf.data_ptr() + 4 * sum(per[:i]) for i in range(3)], 4
        ).launch
        launch(1, 3), launch(0, 1)
        back = torch.cat(
            [buf[sum(per[:i]) : sum(per[: i + 1])].view(c.shape) for i, c in enumerate(got)],
            dim=2,
        )
        assert torch.equal(back[0], whole[0]) and torch.equal(
            back[1][:, 3:], whole[1][:, 3:]
        ), "addressed"
    dst = [torch.zeros_like(t) for t in layers]
    kv2 = PagedKV.wrap(dst, "flash_attn").grouped([0, 1, 0])
    T(kv2).scatter(slots, got)()
    for layer, row in ((0, 0), (1, 1), (2, 0)):
        keep = slots[row] >= 0
        assert torch.equal(
            dst[layer][:, slots[row][keep] // 4, slots[row][keep] % 4], whole[layer][:, keep]
        ), T.__name__
    written = sum(int(d.abs().sum(dim=(0, 3, 4)).ne(0).sum()) for d in dst)
    # nothing at layer 1's -1 tokens, nothing elsewhere
    assert written == 11 + 8 + 11, (T.__name__, written)
print("ok")
"""


def test_grouped_kv_kernels_use_each_layers_own_slots():
    """vLLM's KV cache groups (hybrid allocator): each layer's tokens at its group's row of
    a [G, T] slot table, -1 skipped; the Triton kernels in the interpreter and the torch
    transfer against the layers indexed by hand."""
    pytest.importorskip("triton")
    out = subprocess.run(
        [sys.executable, "-c", GROUPED_CHECK],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "ok"


UPLOAD_CHECK = """
import torch
from kvtier.transfer.kernels import host_runs_kernel
from kvtier.transfer.staging import Staging

pool = torch.arange(7 * 4 * 2 * 24 * 2 * 16 // 4, dtype=torch.int64).view(torch.bfloat16)
per = pool.numel() // 7
blocks = [pool[i * per : (i + 1) * per].view(4, 2, 24, 2, 16) for i in range(7)]
for order in ([0, 1, 2, 3], [0, 2, 4, 5, 6], [6, 5, 3, 1]):  # adjacent, gaps, reversed
    chunks = [blocks[i] for i in order]
    for layer_major in (True, False):
        staging = Staging(chunks, torch.device("cpu"), layer_major=layer_major,
                          groups=1 if layer_major else 2)
        staging.flat.zero_()
        parts = ([staging.run_table(layer=l) for l in range(4)] if layer_major
                 else [staging.run_table(group=g) for g in range(len(staging.groups))])
        for runs in parts:
            table = torch.tensor([(*r[:4], r[4] // 8, r[5]) for r in runs], dtype=torch.int64)
            # few programs, many blocks each
            host_runs_kernel[(3,)](table.data_ptr(), len(runs), BLOCK=64)
        ptrs = staging.ptrs(range(4))
        base = staging.flat.data_ptr()
        for c, chunk in enumerate(chunks):
            for l in range(4):
                at = (int(ptrs[l, c]) - base) // 2
                got = staging.flat.view(torch.bfloat16)[at : at + chunk[l].numel()]
                assert torch.equal(
                    got.view(torch.int16), chunk[l].reshape(-1).view(torch.int16)
                ), (order, layer_major, c, l)
print("ok")
"""


def test_the_upload_kernel_stages_what_the_copy_engine_would():
    """host_runs_kernel (loads from CPU RAM without the copy engine), by Triton's interpreter,
    over Staging.run_table: every layer of every chunk lands where the scatter reads it."""
    pytest.importorskip("triton")
    out = subprocess.run(
        [sys.executable, "-c", UPLOAD_CHECK],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "ok"


def test_a_request_of_any_size_runs_the_kernels_compiled_at_start():
    """Triton compiles a kernel again for each new specialization of its arguments (a count
    of 1, one divisible by 16, a 16-byte-aligned address). The values that change with the
    request (token and chunk counts, slot tables, host addresses) must not change the key:
    the engine's warm-up compiles each kernel once, and a request's first store of two
    chunks or first partial load must not compile (249 and 134 ms inside vLLM on an H100)."""
    pytest.importorskip("triton")
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl

    from kvtier.transfer import kernels

    counts = [1, 2, 15, 16, 256, 400]
    base = torch.zeros(64, dtype=torch.int64)
    tensors = [base, base[1:], base[2:]]  # aligned to 16 bytes, 8, 16
    addresses = [base.data_ptr() + 8 * i for i in range(4)]
    samples = {
        "T": counts,
        "S": [0, *counts],
        "n": counts,
        "runs": counts,
        "slots": tensors,
        "chunk_ptrs": tensors,
        "table": tensors,
        "out": tensors,
        "dst": tensors,
        "src": addresses,
        "table_addr": addresses,
    }
    checked = 0
    for kernel in (
        kernels.kv_copy_kernel,
        kernels.kv_quant_copy_kernel,
        kernels.digest_kernel,
        kernels.host_words_kernel,
        kernels.host_runs_kernel,
    ):
        for p in kernel.params:
            if p.name in samples:
                keys = {
                    native_specialize_impl(
                        BaseBackend,
                        v,
                        False,
                        not p.do_not_specialize,
                        not p.do_not_specialize_on_alignment,
                    )
                    for v in samples[p.name]
                }
                assert len(keys) == 1, f"{kernel.fn.__name__}({p.name}) specializes: {keys}"
                checked += 1
    assert checked == 16


def test_a_run_goes_to_the_copy_kernel_as_source_then_destination_either_way():
    """host_runs_kernel reads (source, destination, their pitches, int64 words, rows): a load's
    runs from the host, a store's (`to_host`) from the device; bytes in whole words."""
    from kvtier.transfer.staging import _directed

    run = (1 << 40, 1 << 20, 4096, 1024, 1024, 7)  # host, device, their pitches, bytes, rows
    assert _directed(run, to_host=False) == (1 << 40, 1 << 20, 4096, 1024, 128, 7)
    assert _directed(run, to_host=True) == (1 << 20, 1 << 40, 1024, 4096, 128, 7)
