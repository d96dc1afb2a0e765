"""The memory-bandwidth roofline of decoding: bytes a step must read, and the read bandwidth
measured on the spot.

A mixture of experts reads, in each sparse layer, only the experts its step's tokens are routed
to: ``WeightBytes`` keeps the routed experts' bytes apart, and a step of ``T`` tokens reads the
share of them that ``T`` tokens reach when each picks ``top_k`` of ``E`` experts uniformly
(``experts_reached``), which is how the random router of ``--load-format dummy`` weights
routes. A trained router's choices cluster, so it reaches fewer: the roofline of a real
checkpoint is then a little higher than this one."""

from __future__ import annotations

import math
import time
from typing import NamedTuple

import torch

from outrider.plugins.models.config import DTYPE_BYTES, ModelConfig
from outrider.plugins.models.fp8.layers import fp8_layout
from outrider.plugins.models.loader import expected_checkpoint_shapes

FP8_BYTES = 1
SCALE_BYTES = 4  # FP8 scales are held in float32 (fp8/layers.py)
# In the name of every routed expert's checkpoint tensor (and in no shared expert's).
_EXPERTS = ".experts."


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


class WeightBytes(NamedTuple):
    """The weights a decode step reads: ``always`` every step, of the routed experts' ``experts``
    bytes (every sparse layer's ``num_experts``; 0 for a dense model) the share its tokens reach."""

    always: int
    experts: int = 0
    num_experts: int = 0
    top_k: int = 0

    @property
    def total(self) -> int:
        return self.always + self.experts

    def per_step(self, tokens: int) -> float:
        """Bytes a step of ``tokens`` tokens reads."""
        if not self.num_experts:
            return float(self.always)
        reached = experts_reached(tokens, self.num_experts, self.top_k)
        return self.always + self.experts * reached / self.num_experts


def experts_reached(tokens: int, num_experts: int, top_k: int) -> float:
    """The expected count of distinct experts of one layer that ``tokens`` tokens reach, each
    routed to ``top_k`` of ``num_experts`` uniformly: an expert is missed by a token with
    probability ``1 - top_k / num_experts``."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def step_weight_bytes(config: ModelConfig, dtype: str) -> WeightBytes:
    """``weight_bytes`` split into what every step reads and the routed experts."""
    sizes = _weight_sizes(config, dtype)
    experts = sum(size for name, size in sizes.items() if _EXPERTS in name)
    if config.moe is None or not experts:
        return WeightBytes(sum(sizes.values()))
    always = sum(sizes.values()) - experts
    return WeightBytes(always, experts, config.moe.num_experts, config.moe.top_k)


def weight_bytes(config: ModelConfig, dtype: str) -> int:
    """Bytes of every weight (the input-embedding table excluded unless tied, in which case it
    is read as the output head): an FP8 checkpoint's quantized weights at one byte each plus
    their float32 scales, everything else in ``dtype``."""
    return sum(_weight_sizes(config, dtype).values())


def _weight_sizes(config: ModelConfig, dtype: str) -> dict[str, int]:
    """Checkpoint tensor name -> its bytes, as ``weight_bytes`` counts them."""
    shapes = expected_checkpoint_shapes(config)
    fp8_weights: frozenset[str] = frozenset()
    scales: dict[str, tuple[int, ...]] = {}
    if config.fp8 is not None:
        layout = fp8_layout(shapes, config.fp8)
        fp8_weights, scales = layout.fp8_weights, layout.scales
    sizes = {}
    for name, shape in (shapes | scales).items():
        if name == "model.embed_tokens.weight" and not config.tie_word_embeddings:
            continue
        if name in fp8_weights:
            size = FP8_BYTES
        elif name in scales:
            size = SCALE_BYTES
        else:
            size = DTYPE_BYTES[dtype]
        sizes[name] = math.prod(shape) * size
    return sizes
