"""FP8 (e4m3) weights and activations: the checkpoint formats (``config.py``), the records and
the reference w8a8 arithmetic every GPU path is held to (``reference.py``), the FP8 linears
and ``use_fp8``, which puts them in a model (``layers.py``), the routed experts in FP8
(``experts.py``), and the Triton kernels of the projections (``kernels.py``) and of the
experts (``moe_kernels.py``).

Invariants:

- This room may import ``moe/``: ``experts.py`` and ``layers.py`` its ``block.Experts``,
  ``moe_kernels.py`` its alignment, tile configs and kernels (private names included: the
  slot sum is shared), ``reference.py`` its sum over experts. ``moe/`` never imports this
  room.
- ``config.py`` imports nothing but the standard library (the start checks read it without
  torch) and ``reference.py`` nothing of Outrider but ``moe/reference.py`` (torch alone):
  ``models/config.py``, ``models/kernels.py`` and ``models/weights.py`` import them, so they
  stay leaves.
- The GPU kernels are reached only through ``models/kernels.py``'s seam
  (``fp8_linear``, ``fused_moe_fp8``), loaded by ``select_kernels`` into ``FusedKernels``.

Nothing is re-exported here: import each name from its module.
"""
