"""The CUDA runtime calls torch does not expose: cudaMemcpy2DAsync, and legacy
CUDA IPC (cudaMalloc, cudaIpcGetMemHandle, cudaIpcOpenMemHandle) for the PD
buffer a sender's kernels write into. torch shares its own allocations so
that only the owning GPU's context maps them (a kernel on another GPU dies
of an illegal address, measured on two H200s); a handle opened here maps
the buffer into the current GPU's context, peer access included.

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
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

_DEFAULT = 4  # cudaMemcpyDefault: direction from the pointers (unified addressing)


@functools.cache
def _lib() -> ctypes.CDLL | None:
    maps = Path("/proc/self/maps")
    paths = (
        {line.split()[-1] for line in maps.read_text().splitlines() if "libcudart.so" in line}
        if maps.exists()
        else set()
    )
    for path in sorted(paths) or ["libcudart.so"]:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        fn = lib.cudaMemcpy2DAsync
        fn.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_size_t,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_void_p,
        ]
        fn.restype = ctypes.c_int
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaGetLastError.restype = ctypes.c_int
        return lib
    return None


def available() -> bool:
    return torch.cuda.is_available() and _lib() is not None


def _loaded() -> ctypes.CDLL:
    lib = _lib()
    if lib is None:
        raise RuntimeError("the CUDA runtime library is not loaded")
    return lib


def _address(ptr: ctypes.c_void_p, call: str) -> int:
    """The address a successful `call` wrote to `ptr` (ctypes reads NULL as None)."""
    if ptr.value is None:
        raise RuntimeError(f"{call} succeeded with a null pointer")
    return ptr.value


def memcpy2d(
    dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, stream: torch.cuda.Stream
) -> None:
    """Copy `height` rows of `width` bytes, rows `spitch` apart at `src`, to rows `dpitch` apart
    at `dst`, queued on `stream`. Asynchronous where the host side is page-locked."""
    lib = _loaded()
    err = lib.cudaMemcpy2DAsync(
        dst, dpitch, src, spitch, width, height, _DEFAULT, stream.cuda_stream
    )
    if err:
        lib.cudaGetLastError()  # clear it, or torch's next CUDA check reports it as its own
        raise RuntimeError(
            f"cudaMemcpy2DAsync failed: {lib.cudaGetErrorString(err).decode()} ({err})"
        )


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]


def _call(name: str, argtypes: Sequence[type], *args: object) -> None:
    lib = _loaded()
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = argtypes, ctypes.c_int
    err = fn(*args)
    if err:
        msg = lib.cudaGetErrorString(err).decode()
        lib.cudaGetLastError()
        raise RuntimeError(f"{name} failed: {msg} ({err})")


def malloc(nbytes: int) -> int:
    """Device memory from cudaMalloc on the current device, outside torch's allocator: its
    IPC handle maps into any GPU context of another process (torch's own sharing does not)."""
    ptr = ctypes.c_void_p()
    _call(
        "cudaMalloc", [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t], ctypes.byref(ptr), nbytes
    )
    return _address(ptr, "cudaMalloc")


def free(ptr: int) -> None:
    _call("cudaFree", [ctypes.c_void_p], ptr)


def ipc_handle(ptr: int) -> bytes:
    handle = _IpcHandle()
    _call(
        "cudaIpcGetMemHandle",
        [ctypes.POINTER(_IpcHandle), ctypes.c_void_p],
        ctypes.byref(handle),
        ptr,
    )
    return bytes(handle.reserved)


def open_ipc_handle(handle: bytes) -> int:
    """Map another process's CUDA allocation into the *current* device's context (with peer
    access), so kernels of this device can read and write it; the base address."""
    ptr, raw = ctypes.c_void_p(), _IpcHandle()
    ctypes.memmove(ctypes.addressof(raw), handle, 64)
    # 1: cudaIpcMemLazyEnablePeerAccess
    _call(
        "cudaIpcOpenMemHandle",
        [ctypes.POINTER(ctypes.c_void_p), _IpcHandle, ctypes.c_uint],
        ctypes.byref(ptr),
        raw,
        1,
    )
    return _address(ptr, "cudaIpcOpenMemHandle")


def close_ipc_handle(ptr: int) -> None:
    _call("cudaIpcCloseMemHandle", [ctypes.c_void_p], ptr)


def host_register(ptr: int, nbytes: int) -> None:
    """Page-lock host memory someone else allocated (a mapping of another
    process's pool) so the GPU copies from it by DMA; read-only where the
    driver allows it (a mapping the GPU never writes)."""
    args = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    try:
        _call("cudaHostRegister", args, ptr, nbytes, 1 | 8)  # portable | read-only
    except RuntimeError:
        _call("cudaHostRegister", args, ptr, nbytes, 1)


def host_unregister(ptr: int) -> None:
    _call("cudaHostUnregister", [ctypes.c_void_p], ptr)


class DeviceBytes:
    """Raw device memory as something torch can view (`torch.as_tensor`). With `release`,
    that is called with the address once no tensor views it any more."""

    def __init__(self, ptr: int, nbytes: int, release: Callable[[int], None] | None = None) -> None:
        self.__cuda_array_interface__ = {
            "data": (ptr, False),
            "shape": (nbytes,),
            "typestr": "|u1",
            "version": 3,
            "strides": None,
        }
        if release is not None:
            weakref.finalize(self, release, ptr)


def device_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """`nbytes` of cudaMalloc'd memory on `device` as a uint8 tensor (freed with the tensor)."""
    with torch.cuda.device(device):
        ptr = malloc(nbytes)
        return torch.as_tensor(DeviceBytes(ptr, nbytes, free), device=device)


def map_ipc_buffer(handle: bytes, nbytes: int) -> torch.Tensor:
    """Another process's `device_buffer`, mapped for the current GPU (closed with the tensor)."""
    ptr = open_ipc_handle(handle)
    return torch.as_tensor(
        DeviceBytes(ptr, nbytes, close_ipc_handle), device=torch.cuda.current_device()
    )
