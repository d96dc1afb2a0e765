"""A Triton kernel that runs the mxfp4 kernels' decoders over every code and every scale byte
(test_gpt_oss.py): a module of its own, as a kernel sees only its module's globals."""

from __future__ import annotations

import triton
import triton.language as tl

from outrider.plugins.models.moe.mxfp4_kernels import _e2m1, _power_of_two


@triton.jit
def decode_kernel(codes_ptr, values_ptr, scales_ptr, powers_ptr):
    codes = tl.load(codes_ptr + tl.arange(0, 16))
    tl.store(values_ptr + tl.arange(0, 16), _e2m1(codes))
    scales = tl.load(scales_ptr + tl.arange(0, 256))
    tl.store(powers_ptr + tl.arange(0, 256), _power_of_two(scales, 127))
