"""The memory-bandwidth roofline of decoding: bytes a step must read, and the read bandwidth
measured on the spot."""

from __future__ import annotations

import time

import torch

from outrider.plugins.models.config import DTYPE_BYTES, ModelConfig
from outrider.plugins.models.loader import expected_checkpoint_shapes


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
    in which case it is read as the output head)."""
    total = 0
    for name, shape in expected_checkpoint_shapes(config).items():
        if name == "model.embed_tokens.weight" and not config.tie_word_embeddings:
            continue
        numel = 1
        for dim in shape:
            numel *= dim
        total += numel
    return total * DTYPE_BYTES[dtype]
