"""The CPU model dtype: bfloat16 where a probe runs it, float32 where the probe dies (AMX hosts)."""

import re

from kvtier.dev.cpu_dtype import PROBE, probe_bf16

SIGILL = "import os, signal; os.kill(os.getpid(), signal.SIGILL)"


def test_a_probe_that_dies_of_sigill_falls_back_to_float32():
    choice = probe_bf16(SIGILL)
    assert choice.dtype == "float32"
    assert "SIGILL" in choice.line() and choice.line().startswith("CPU model dtype: float32")


def test_a_probe_that_hangs_or_fails_falls_back_to_float32():
    hung = probe_bf16("import time; time.sleep(30)", timeout=1)
    assert hung.dtype == "float32" and "within 1 s" in hung.reason
    failed = probe_bf16("raise SystemExit('no bf16 here')")
    assert failed.dtype == "float32" and "code 1" in failed.reason and "no bf16 here" in failed.reason


def test_the_real_probe_answers_and_covers_both_bf16_paths():
    assert "a @ b" in PROBE and "weight_packed_linear_cpu" in PROBE  # torch's matmul and vLLM's packed GEMM
    choice = probe_bf16()
    assert choice.dtype in ("bfloat16", "float32")
    with open("/proc/cpuinfo") as f:
        amx = re.search(r"\bamx_tile\b", f.read()) is not None
    if not amx:  # without AMX tiles, nothing in torch or vLLM takes the path that dies
        assert choice.dtype == "bfloat16", choice.reason
