"""Lossy KV codecs (`remote_serde: int8 | fp8`): chunks of 1-byte values and per-head scales.

A quantized chunk keeps the chunk's shape of rows, one per (layer, K or V,
token), each row the token's NH heads of HS values in one byte, then one
float32 scale per head:

    chunk        [L, K, T, R] uint8,   R = NH*HS + 4*NH
    row          | q[h=0, 0..HS) .. q[h=NH-1, ..) | scale[0] .. scale[NH-1] |

    value = q * scale,   scale = max |x| over the head / QMAX

int8 rounds to the nearest step, ties up (|error| <= scale / 2); fp8 is e4m3
(relative error <= 2^-4, and at most scale * 2^-10 near zero). A zero head
has scale 0. At HS = 128 a token costs 0.516 of its bf16 bytes.

Quantizing happens where the KV leaves the engine: in the gather kernel
before the device-to-host copy (Triton), or in torch on a host cache; the
reverse in the scatter. So every tier (CPU RAM included) holds the
quantized chunk and moves about half the bytes, and the chunk's checksum
covers the quantized bytes. The chunk key names the codec, so a lossy chunk
is never read as a lossless one. This module holds the format and the torch
codec; the Triton kernel lives beside the copy kernel (triton_copy.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.codec import KV_CODECS

QMAX = {"int8": 127.0, "fp8": 448.0}  # largest |q|: int8, and float8 e4m3
SCALE_BYTES = 4  # float32


@dataclass(frozen=True)
class Quant:
    """One lossy codec for chunks of a KV cache with `heads` heads of `head_size`."""

    name: str  # "int8" | "fp8"
    heads: int
    head_size: int

    def __post_init__(self) -> None:
        if self.name not in QMAX:
            raise ValueError(f"KV codec {self.name!r}: expected one of {', '.join(KV_CODECS)}")

    @property
    def qmax(self) -> float:
        return QMAX[self.name]

    @property
    def row_bytes(self) -> int:
        """Bytes of one (layer, K or V, token) row: values, then scales."""
        return self.heads * self.head_size + SCALE_BYTES * self.heads

    def bytes_per_token(self, num_layers: int, kv: int) -> int:
        return num_layers * kv * self.row_bytes

    def encode(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """x: [..., NH, HS] of a float dtype → out: [..., R] uint8 (same leading dims)."""
        x = x.float()
        amax = x.abs().amax(dim=-1)  # [..., NH]
        scale = amax / self.qmax
        inv = torch.where(amax > 0, self.qmax / amax, torch.zeros_like(amax))
        y = (x * inv[..., None]).clamp_(-self.qmax, self.qmax)
        if self.name == "int8":  # ties up, as the kernel does
            q = (y + 0.5).floor_().to(torch.int8).view(torch.uint8)
        else:
            q = y.to(torch.float8_e4m3fn).view(torch.uint8)
        w = self.heads * self.head_size
        out[..., :w].copy_(q.flatten(-2))
        out[..., w:].copy_(scale.contiguous().view(torch.uint8).reshape(*scale.shape[:-1], -1))

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """rows: [..., R] uint8 → [..., NH, HS] of `dtype`."""
        w = self.heads * self.head_size
        lead = rows.shape[:-1]
        q = rows[..., :w].contiguous().reshape(*lead, self.heads, self.head_size)
        q = q.view(torch.int8) if self.name == "int8" else q.view(torch.float8_e4m3fn)
        scale = rows[..., w:].contiguous().view(torch.float32).reshape(*lead, self.heads)
        return (q.float() * scale[..., None]).to(dtype)

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        """The largest |decode(encode(x)) - x| the codec allows, per element of x [..., NH, HS]
        (plus the rounding of the output dtype, which the caller adds)."""
        x = x.float()
        amax = x.abs().amax(dim=-1, keepdim=True).expand_as(x)
        scale, fp32 = amax / self.qmax, amax * 2.0**-20  # fp32's own rounding of the scaling
        if self.name == "int8":
            return scale / 2 + fp32
        return x.abs() / 16 + scale * 2.0**-9 + fp32
