"""The CPU model dtype: bfloat16 where a probe runs it, float32 where it dies, on AMX and where
bf16 is emulated."""

import re

from kvtier_tools.dev.cpu_dtype import PROBE, probe_bf16

SIGILL = "import os, signal; os.kill(os.getpid(), signal.SIGILL)"


def test_a_probe_that_dies_of_sigill_falls_back_to_float32():
    choice = probe_bf16(SIGILL)
    assert choice.dtype == "float32"
    assert "SIGILL" in choice.line() and choice.line().startswith("CPU model dtype: float32")


def test_a_probe_that_hangs_or_fails_falls_back_to_float32():
    hung = probe_bf16("import time; time.sleep(30)", timeout=1)
    assert hung.dtype == "float32" and "within 1 s" in hung.reason
    failed = probe_bf16("raise SystemExit('no bf16 here')")
    assert (
        failed.dtype == "float32" and "code 1" in failed.reason and "no bf16 here" in failed.reason
    )


def test_the_real_probe_answers_and_covers_both_bf16_paths():
    # torch's matmul and vLLM's packed GEMM
    assert "a @ b" in PROBE and "weight_packed_linear_cpu" in PROBE
    choice = probe_bf16()
    assert choice.dtype in ("bfloat16", "float32")
    with open("/proc/cpuinfo") as f:
        amx = re.search(r"\bamx_tile\b", f.read()) is not None
    if not amx:  # without AMX tiles, nothing in torch or vLLM takes the path that dies
        assert choice.dtype == "bfloat16", choice.reason


def test_an_x86_cpu_with_amx_runs_float32_without_probing():
    """A Xeon with AMX (2026-12-02): its bf16 probe passed, and vLLM's attention took its amx
    kernel (whole 128-token blocks), so hits and the guides' counts changed with the host."""
    from kvtier_tools.dev.cpu_dtype import AMX_REASON, cpu_model_dtype, has_amx

    assert has_amx("flags\t\t: fpu avx512f amx_bf16 amx_tile amx_int8\n")
    assert not has_amx("flags\t\t: fpu avx512f avx512_bf16\n")
    with open("/proc/cpuinfo") as f:
        if has_amx(f.read()):
            assert cpu_model_dtype().dtype == "float32" and cpu_model_dtype().reason == AMX_REASON


def test_an_x86_cpu_without_native_bf16_runs_float32_without_probing():
    """An AMD EPYC with AVX2 only (2026-11-29): bf16 emulated, slower, and a warm request's
    greedy tokens parted from plain vLLM's at a near-tie; float32 there."""
    from kvtier_tools.dev.cpu_dtype import cpu_model_dtype, native_bf16

    avx2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n"
    assert native_bf16(avx2) is False
    assert native_bf16(avx2.replace("avx2", "avx2 avx512f avx512_bf16")) is True
    assert native_bf16(avx2.replace("avx2", "avx2 amx_tile amx_bf16")) is True
    assert native_bf16("Processor\t: AArch64\n") is None  # not x86: the probe decides
    with open("/proc/cpuinfo") as f:
        if native_bf16(f.read()) is False:
            assert cpu_model_dtype().dtype == "float32" and "emulated" in cpu_model_dtype().reason
