"""What the fused mixture-of-experts layer holds on the device at its peak beyond its inputs
and output, for the start-up memory plan (``daemon/engine/memory_plan.py``), which imports it
on any host: nothing here imports torch or Triton.

The grouped path (``kernels.py``, ``fp8/moe_kernels.py``) runs at most ``MAX_CHUNK_PAIRS``
routed (token, slot) pairs at a time. Each pair holds its intermediate row ``[I]`` in the
model dtype (with FP8 experts also its e4m3 copy), its down product ``[H]`` in float32 until
the slots are summed, and its place in the expert-sorted order. The decode path's buffers
(an intermediate row a pair, a few batches' worth) are small and run inside the CUDA
graphs' estimate.
"""

from __future__ import annotations

# The grouped path runs at most this many pairs at a time, which bounds its float32 per-pair
# buffer (MAX_CHUNK_PAIRS * H * 4 bytes: 128 MiB at H = 2048).
MAX_CHUNK_PAIRS = 16384
# A pair's bookkeeping: its sorted place (padded to whole row blocks) and, quantized, its
# row's float32 scales (one per group of at least 16 columns) — a bound, not an exact count.
_PAIR_BOOKKEEPING_BYTES = 16


def grouped_bytes(tokens: int, top_k: int, hidden: int, intermediate: int, itemsize: int) -> int:
    """The grouped path's peak for ``tokens`` tokens routed to ``top_k`` experts each, with
    ``intermediate`` rows per expert (a rank's share) in a dtype of ``itemsize`` bytes."""
    pairs = min(tokens * top_k, MAX_CHUNK_PAIRS)
    per_pair = 4 * hidden + (itemsize + 1) * intermediate + _PAIR_BOOKKEEPING_BYTES
    return pairs * per_pair
