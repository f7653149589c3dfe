"""Which dtype a model runs in on this CPU: bfloat16 where it works, else float32.

On some x86 hosts with AMX (`amx_tile` in /proc/cpuinfo) the CPU wheel of
torch 2.13 dies with SIGILL in oneDNN's bf16 matmul, and vLLM's own AMX GEMM
(`weight_packed_linear`, used for small bf16 weights) dies the same way;
float32 runs there. Where bf16 works it is faster (measured on a 2-core
AMD EPYC with avx512_bf16, 8,000-token demo: cold TTFT 4.96 s in bf16 vs
6.34 s in float32), so kvtier keeps it and probes for it:

    probe   a fresh Python runs both bf16 paths on small tensors
    passes  -> bfloat16
    dies    (SIGILL or any other exit, or no answer within the timeout)
            -> float32, with one line that says why

The probe runs in a subprocess because SIGILL kills the process that
executes the instruction: in a subprocess it is an answer, not a crash.

On any x86 CPU with AMX the models run in float32 without probing (2026-12-02: on a
Xeon with AMX the probe passed, and vLLM's attention then took its amx kernel, which moves
KV in whole 128-token blocks: a hit lost its partial last block, the guides' and tests'
per-token counts changed with the host, and vLLM's AMX_MLA backend, chosen there for MLA
models, takes no float32 weights: tests name CPU_MLA).

An x86 CPU without native bf16 (neither `avx512_bf16` nor `amx_bf16`; e.g. an
AMD EPYC with AVX2 only, 2026-11-29) runs float32 without probing: there
torch and vLLM emulate bf16, slower, and its rounding followed the shape of
vLLM's batches, so a warm request's greedy tokens parted from plain vLLM's
at a near-tie of the seeded test model (tests/test_vllm_connector.py failed
on this alone, at 247a0fe as at HEAD).
"""

from __future__ import annotations

import functools
import re
import signal
import subprocess
import sys
from dataclasses import dataclass

# Both bf16 paths a CPU model takes: torch's matmul (oneDNN) and, when vLLM is
# installed, vLLM's packed GEMM for small weights. Either one may SIGILL.
PROBE = """
import torch
a = torch.randn(256, 1024, dtype=torch.bfloat16)
b = torch.randn(1024, 2048, dtype=torch.bfloat16)
assert torch.isfinite((a @ b).float()).all()
try:
    from vllm import _custom_ops as ops
except ImportError:
    ops = None
if ops is not None and hasattr(torch.ops._C, "convert_weight_packed"):
    w = torch.randn(256, 512, dtype=torch.bfloat16)
    packed = torch.ops._C.convert_weight_packed(w)
    y = ops.weight_packed_linear_cpu(torch.randn(8, 512, dtype=torch.bfloat16), packed, 256, None)
    assert torch.isfinite(y.float()).all()
"""


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str  # "bfloat16" or "float32"
    reason: str
    device: str = "cpu"  # where vLLM runs the model: "cpu" or "cuda"

    def line(self) -> str:
        return f"{self.device.upper()} model dtype: {self.dtype} ({self.reason})"


def probe_bf16(code: str = PROBE, timeout: float = 120.0) -> DtypeChoice:
    """Run `code` in a fresh Python; bfloat16 if it exits 0, else float32 and why."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return DtypeChoice("float32", f"the bf16 probe gave no answer within {timeout:.0f} s")
    if done.returncode == 0:
        return DtypeChoice("bfloat16", "a bf16 matmul probe passed")
    if done.returncode == -signal.SIGILL:
        return DtypeChoice(
            "float32",
            "the bf16 probe died of SIGILL: this CPU's AMX bf16 path in torch/vLLM "
            "fails here, so models run in float32",
        )
    tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or [""]
    return DtypeChoice(
        "float32", f"the bf16 probe exited with code {done.returncode} ({tail[0][:200]})"
    )


NATIVE_BF16 = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of x86 CPUs that compute in bf16
AMX_REASON = (
    "this CPU has AMX: vLLM's CPU attention takes bf16 there in its amx kernel, whose KV moves "
    "in whole 128-token blocks (a hit's partial last block is computed again), and on some AMX "
    "hosts bf16 dies with SIGILL; float32 runs the vec kernel, a hit to the token"
)


def native_bf16(cpuinfo: str) -> bool | None:
    """Whether this x86 CPU computes in bf16 itself (None: not an x86 /proc/cpuinfo)."""
    flags = next(
        (
            line.split(":", 1)[1].split()
            for line in cpuinfo.splitlines()
            if line.startswith("flags")
        ),
        None,
    )
    return None if flags is None else any(f in flags for f in NATIVE_BF16)


def has_amx(cpuinfo: str) -> bool:
    """Whether /proc/cpuinfo's flags name AMX tiles."""
    return re.search(r"\bamx_tile\b", cpuinfo) is not None


@functools.cache
def cpu_model_dtype() -> DtypeChoice:
    """float32 on an x86 CPU without native bf16 or with AMX; else the probe's answer. Asked
    once per process."""
    try:
        with open("/proc/cpuinfo") as f:
            cpuinfo = f.read()
    except OSError:
        cpuinfo = ""
    if native_bf16(cpuinfo) is False:
        return DtypeChoice(
            "float32", f"this CPU has none of {', '.join(NATIVE_BF16)}: bf16 would be emulated"
        )
    if has_amx(cpuinfo):
        return DtypeChoice("float32", AMX_REASON)
    return probe_bf16()


@functools.cache
def model_dtype() -> DtypeChoice:
    """The dtype vLLM runs the demo's and tests' models in here: bfloat16 on a CUDA GPU
    (its attention kernels take no float32), else this CPU's (the probe)."""
    import torch

    if torch.cuda.is_available():
        return DtypeChoice("bfloat16", torch.cuda.get_device_name(), device="cuda")
    return cpu_model_dtype()
