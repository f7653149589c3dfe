"""The CUDA runtime calls torch does not expose: cudaMemcpy2DAsync, and
cudaDeviceEnablePeerAccess (a PD sender's kernels write into a decoder's GPU).

A layerwise transfer moves layer l of every chunk of a request. Chunks sit
in separate pool blocks, so layer l of n chunks is n separate ranges; when
the blocks are adjacent in the pool, those ranges are equally spaced, and
one strided (2-D) copy moves them all:

    host pool      | chunk 0: L0 L1 .. | chunk 1: L0 L1 .. | chunk 2: ...
                      ^ width            ^ +pitch            ^ +2 pitch
    device staging | L0 c0 | L0 c1 | L0 c2 | L1 c0 | ...

One call per layer instead of one per (layer, chunk): at 32k tokens of an
8B model that is 32 calls instead of 4,096, which is what kept the host
thread from launching the model's forward in time.

The runtime library is the one torch has already loaded (found through
/proc/self/maps), so there is no second copy of it and no new dependency.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

_DEFAULT = 4  # cudaMemcpyDefault: direction from the pointers (unified addressing)


@functools.cache
def _lib() -> ctypes.CDLL | None:
    maps = Path("/proc/self/maps")
    paths = {line.split()[-1] for line in maps.read_text().splitlines() if "libcudart.so" in line} \
        if maps.exists() else set()
    for path in sorted(paths) or ["libcudart.so"]:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        fn = lib.cudaMemcpy2DAsync
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                       ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaGetLastError.restype = ctypes.c_int
        return lib
    return None


def available() -> bool:
    return torch.cuda.is_available() and _lib() is not None


def memcpy2d(dst: int, dpitch: int, src: int, spitch: int, width: int, height: int,
             stream: torch.cuda.Stream) -> None:
    """Copy `height` rows of `width` bytes, rows `spitch` apart at `src`, to rows `dpitch` apart at `dst`,
    queued on `stream`. Asynchronous where the host side is page-locked."""
    lib = _lib()
    err = lib.cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, _DEFAULT, stream.cuda_stream)
    if err:
        lib.cudaGetLastError()  # clear it, or torch's next CUDA check reports it as its own
        raise RuntimeError(f"cudaMemcpy2DAsync failed: {lib.cudaGetErrorString(err).decode()} ({err})")


def enable_peer_access(peer: int) -> None:
    """Let kernels on the current device read and write memory of device `peer` (NVLink/PCIe P2P)."""
    lib = _lib()
    if lib is None:
        raise RuntimeError("the CUDA runtime library is not loaded")
    fn = lib.cudaDeviceEnablePeerAccess
    fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_uint], ctypes.c_int
    err = fn(peer, 0)
    if err not in (0, 704):  # 704: cudaErrorPeerAccessAlreadyEnabled
        msg = lib.cudaGetErrorString(err).decode()
        lib.cudaGetLastError()
        raise RuntimeError(f"cudaDeviceEnablePeerAccess({peer}) failed: {msg} ({err})")
    lib.cudaGetLastError()


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


def open_ipc_handle(handle: bytes) -> int:
    """Map another process's CUDA allocation into the *current* device's context (with peer
    access), so kernels of this device can read and write it; the base address."""
    lib = _lib()
    if lib is None:
        raise RuntimeError("the CUDA runtime library is not loaded")
    fn = lib.cudaIpcOpenMemHandle
    fn.argtypes, fn.restype = [ctypes.POINTER(ctypes.c_void_p), _IpcHandle, ctypes.c_uint], ctypes.c_int
    ptr = ctypes.c_void_p()
    err = fn(ctypes.byref(ptr), _IpcHandle(handle[:64]), 1)  # 1: cudaIpcMemLazyEnablePeerAccess
    if err:
        msg = lib.cudaGetErrorString(err).decode()
        lib.cudaGetLastError()
        raise RuntimeError(f"cudaIpcOpenMemHandle failed: {msg} ({err})")
    return int(ptr.value)


class DeviceBytes:
    """Raw device memory as something torch can view (`torch.as_tensor`): no ownership."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": (nbytes,), "typestr": "|u1",
                                         "version": 3, "strides": None}
