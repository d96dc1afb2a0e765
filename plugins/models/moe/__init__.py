"""Mixture of experts: the sparse MLP block, its experts and router, and the decoder that puts
the block in the layers its config names (``block.py``); the fused Triton kernels
(``kernels.py``), the device-side grouping of routed pairs by expert (``align.py``), the
kernels' tile configs per shape with their JSON tables in ``configs/`` (``tiles.py``), the
tuner that writes those tables (``python -m outrider.plugins.models.moe.tune``), and what the
kernels hold at their peak, for the memory plan (``memory.py``, which imports no torch);
the reference sum over a token's experts that the 16-bit and FP8 references share
(``reference.py``, torch alone). The
architecture files (``qwen3_moe.py``, ``mixtral.py``, ``qwen2_moe.py``) stay one level up,
beside the dense ones.

Invariants:

- Nothing here imports ``fp8/``; FP8 experts build on this room, never the reverse.
- ``block.py`` reaches the kernels only through the ``UsesKernels`` seam
  (``kernels.fused_moe``): ``select_kernels`` (``plugins/models/kernels.py``) loads
  ``kernels.py`` into ``FusedKernels`` on a GPU. ``block.py`` imports no Triton, so a mixture
  of experts builds and runs the reference where Triton is not installed.

Nothing is re-exported here: import each name from its module.
"""
