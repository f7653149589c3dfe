"""Lossy KV codecs (`remote_serde: int8 | fp8 | int4`): chunks of quantized values and scales.

A quantized chunk keeps the chunk's shape of rows, one per (layer, K or V,
token). int8 and fp8 keep each of the token's NH heads of HS values in one
byte, then one float32 scale per head:

    chunk        [L, K, T, R] uint8,   R = NH*HS + 4*NH
    row          | q[h=0, 0..HS) .. q[h=NH-1, ..) | scale[0] .. scale[NH-1] |

    value = q * scale,   scale = max |x| over the head / QMAX

int4 keeps two values a byte and a float16 scale per group of G values of a
head (G = 32 where HS allows; KIVI's per-token grouping):

    row          | byte[h, g, e] for h < NH, g < HS/G, e < G/2 | scale[h, g] ... | pad to 4 |
    byte[h, g, e] = q[h, g*G + e] & 0xF | q[h, g*G + G/2 + e] << 4    (two's complement)

int8 and int4 round to the nearest step, ties up (|error| <= scale / 2); fp8
is e4m3 (relative error <= 2^-4, and at most scale * 2^-10 near zero). A zero
head or group has scale 0. At HS = 128 a token costs 0.516 of its bf16 bytes
in int8 or fp8, 0.281 in int4.

Quantizing happens where the KV leaves the engine: in the gather kernel
before the device-to-host copy (Triton), or in torch on a host cache; the
reverse in the scatter. So every tier (CPU RAM included) holds the
quantized chunk and moves a half (or a quarter) of the bytes, and the
chunk's checksum covers the quantized bytes. The chunk key names the codec,
so a lossy chunk is never read as a lossless one. This module holds the
format and the torch codec; the Triton kernels live beside the copy kernel
(kernels.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.codec import KV_CODECS

QMAX = {"int8": 127.0, "fp8": 448.0, "int4": 7.0}  # largest |q|: int8, float8 e4m3, int4
SCALE_BYTES = 4  # float32, per head (int8, fp8)
INT4_GROUPS = (32, 16, 8)  # the first that divides HS is int4's group
FP16_MAX = 65504.0


@dataclass(frozen=True)
class Quant:
    """One lossy codec for chunks of a KV cache with `heads` heads of `head_size`."""

    name: str  # "int8" | "fp8" | "int4"
    heads: int
    head_size: int

    def __post_init__(self) -> None:
        if self.name not in QMAX:
            raise ValueError(f"KV codec {self.name!r}: expected one of {', '.join(KV_CODECS)}")
        if self.name == "int4" and not any(self.head_size % g == 0 for g in INT4_GROUPS):
            raise ValueError(
                f"KV codec int4: head size {self.head_size} is not a multiple of 8; use int8 or fp8"
            )

    @property
    def qmax(self) -> float:
        return QMAX[self.name]

    @property
    def group(self) -> int:
        """Values that share a scale: a head (int8, fp8) or a group of a head (int4)."""
        if self.name != "int4":
            return self.head_size
        return next(g for g in INT4_GROUPS if self.head_size % g == 0)

    @property
    def groups(self) -> int:
        """Scales of one head."""
        return self.head_size // self.group

    @property
    def value_bytes(self) -> int:
        """Bytes of one row's quantized values (the scales follow them)."""
        values = self.heads * self.head_size
        return values // 2 if self.name == "int4" else values

    @property
    def row_bytes(self) -> int:
        """Bytes of one (layer, K or V, token) row: values, then scales."""
        if self.name != "int4":
            return self.value_bytes + SCALE_BYTES * self.heads
        return -(-(self.value_bytes + 2 * self.heads * self.groups) // 4) * 4

    def bytes_per_token(self, num_layers: int, kv: int) -> int:
        return num_layers * kv * self.row_bytes

    def encode(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """x: [..., NH, HS] of a float dtype → out: [..., R] uint8 (same leading dims)."""
        if self.name == "int4":
            self._encode_int4(x, out)
            return
        x = x.float()
        amax = x.abs().amax(dim=-1)  # [..., NH]
        scale = amax / self.qmax
        inv = torch.where(amax > 0, self.qmax / amax, torch.zeros_like(amax))
        y = (x * inv[..., None]).clamp_(-self.qmax, self.qmax)
        if self.name == "int8":  # ties up, as the kernel does
            q = (y + 0.5).floor_().to(torch.int8).view(torch.uint8)
        else:
            q = y.to(torch.float8_e4m3fn).view(torch.uint8)
        w = self.value_bytes
        out[..., :w].copy_(q.flatten(-2))
        out[..., w:].copy_(scale.contiguous().view(torch.uint8).reshape(*scale.shape[:-1], -1))

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """rows: [..., R] uint8 → [..., NH, HS] of `dtype`."""
        if self.name == "int4":
            return self._decode_int4(rows, dtype)
        w = self.value_bytes
        lead = rows.shape[:-1]
        q = rows[..., :w].contiguous().reshape(*lead, self.heads, self.head_size)
        q = q.view(torch.int8) if self.name == "int8" else q.view(torch.float8_e4m3fn)
        scale = rows[..., w:].contiguous().view(torch.float32).reshape(*lead, self.heads)
        return (q.float() * scale[..., None]).to(dtype)

    def _encode_int4(self, x: torch.Tensor, out: torch.Tensor) -> None:
        lead = x.shape[:-2]
        g = x.float().reshape(*lead, self.heads, self.groups, self.group)
        amax = g.abs().amax(dim=-1)  # [..., NH, NG]
        scale = (amax / self.qmax).clamp_(max=FP16_MAX).to(torch.float16)
        s = scale.float()
        inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
        y = (g * inv[..., None]).clamp_(-self.qmax, self.qmax)
        q = (y + 0.5).floor_().to(torch.int16) & 0xF
        half = self.group // 2
        packed = (q[..., :half] | (q[..., half:] << 4)).to(torch.uint8)
        w = self.value_bytes
        out[..., :w].copy_(packed.reshape(*lead, w))
        scale_bytes = scale.contiguous().view(torch.uint8).reshape(*lead, -1)
        out[..., w : w + scale_bytes.shape[-1]].copy_(scale_bytes)
        out[..., w + scale_bytes.shape[-1] :].zero_()

    def _decode_int4(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        lead = rows.shape[:-1]
        w = self.value_bytes
        half = self.group // 2
        b = rows[..., :w].contiguous().reshape(*lead, self.heads, self.groups, half).to(torch.int16)
        nibbles = torch.cat([b & 0xF, b >> 4], dim=-1)  # [..., NH, NG, G]
        q = nibbles - ((nibbles & 8) << 1)  # two's complement of 4 bits
        n = 2 * self.heads * self.groups
        scale = rows[..., w : w + n].contiguous().view(torch.float16).float()
        scale = scale.reshape(*lead, self.heads, self.groups, 1)
        return (q.float() * scale).reshape(*lead, self.heads, self.head_size).to(dtype)

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        """The largest |decode(encode(x)) - x| the codec allows, per element of x [..., NH, HS]
        (plus the rounding of the output dtype, which the caller adds)."""
        x = x.float()
        lead = x.shape[:-2]
        g = x.reshape(*lead, self.heads, self.groups, self.group)
        amax = g.abs().amax(dim=-1, keepdim=True).expand_as(g).reshape(x.shape)
        scale, fp32 = amax / self.qmax, amax * 2.0**-20  # fp32's own rounding of the scaling
        if self.name == "int8":
            return scale / 2 + fp32
        if self.name == "int4":
            # half a step of the float16 scale, and the values clamped where rounding the scale
            # to float16 (2^-11 relative, 2^-25 absolute below its normal range) lowered it
            fp16 = scale * 2.0**-11 + 2.0**-25
            return scale / 2 + fp16 / 2 + self.qmax * fp16 + fp32
        return x.abs() / 16 + scale * 2.0**-9 + fp32
