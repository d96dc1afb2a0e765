"""The memory-bandwidth roofline of decoding: bytes a step must read, and the read bandwidth
measured on the spot."""

from __future__ import annotations

import math
import time

import torch

from outrider.plugins.models.config import DTYPE_BYTES, ModelConfig
from outrider.plugins.models.fp8_layers import fp8_layout
from outrider.plugins.models.loader import expected_checkpoint_shapes

FP8_BYTES = 1
SCALE_BYTES = 4  # FP8 scales are held in float32 (fp8_layers.py)


def read_bandwidth(device: str, gib: float = 4.0) -> float:
    """Bytes/s of a full read (a sum) over a buffer far larger than the caches (the best of
    ten on CUDA, of three on CPU, where ``gib`` is capped at 1)."""
    cuda = device == "cuda"
    size = int((gib if cuda else min(gib, 1.0)) * 2**30)
    x = torch.ones(size // 4, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(10 if cuda else 3):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        x.sum()
        if cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    del x
    if cuda:
        torch.cuda.empty_cache()
    return size / best


def weight_bytes(config: ModelConfig, dtype: str) -> int:
    """Bytes of every weight read per step (the input-embedding table excluded unless tied,
    in which case it is read as the output head): an FP8 checkpoint's quantized weights at
    one byte each plus their float32 scales, everything else in ``dtype``."""
    shapes = expected_checkpoint_shapes(config)
    fp8_weights: frozenset[str] = frozenset()
    scales: dict[str, tuple[int, ...]] = {}
    if config.fp8 is not None:
        layout = fp8_layout(shapes, config.fp8)
        fp8_weights, scales = layout.fp8_weights, layout.scales
    total = 0
    for name, shape in (shapes | scales).items():
        if name == "model.embed_tokens.weight" and not config.tie_word_embeddings:
            continue
        if name in fp8_weights:
            size = FP8_BYTES
        elif name in scales:
            size = SCALE_BYTES
        else:
            size = DTYPE_BYTES[dtype]
        total += math.prod(shape) * size
    return total
