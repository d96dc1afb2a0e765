"""The mxfp4 format of gpt-oss's experts (OCP microscaling FP4): blocks of 32 values along a
row's input features, each value a 4-bit e2m1 float (sign, 2 exponent bits, 1 mantissa bit:
0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives), two to a byte (the even index in the low
nibble), and one e8m0 scale a block (a byte ``s``: the factor ``2 ** (s - 127)``).

A weight of ``[rows, in]`` is stored as ``blocks`` uint8 ``[rows, in / 32, 16]`` and ``scales``
uint8 ``[rows, in / 32]`` (leading dimensions, an expert's, go before both). Every value it
encodes is exact in bfloat16 and float32 while its scale stays within their exponent range.
"""

from __future__ import annotations

import torch

BLOCK = 32  # values a scale covers
SCALE_BIAS = 127
# The e2m1 value of each nibble.
E2M1_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``blocks: [..., G, 16]``, ``scales: [..., G]`` -> the weight ``[..., G * 32]`` in
    ``dtype``."""
    table = torch.tensor(E2M1_VALUES, dtype=dtype, device=blocks.device)
    low, high = table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]
    values = torch.stack((low, high), dim=-1).flatten(-2)  # [..., G, 32]
    exponents = scales.to(torch.int32) - SCALE_BIAS
    return torch.ldexp(values, exponents.unsqueeze(-1)).to(dtype).flatten(-2)
