"""The reference sum over a token's routed experts, which the 16-bit reference kernels
(``TorchKernels.fused_moe``) and the FP8 reference (``fp8/reference.py`` ``w8a8_moe``) share:
what each expert computes is theirs, how the products add up is this module's.

Invariant: ``out[t]`` is the sum over the token's slots ``j`` of ``topk_weights[t, j]`` times
its expert's product, each weighted product rounded to ``x``'s dtype and added in ascending
expert order from zero (as transformers adds them), on either path. It imports torch alone,
so both references stay leaves.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# (the rows of x an expert runs, the expert's index) -> its product, [n, H] in x's dtype.
ExpertProduct = Callable[[torch.Tensor, int], torch.Tensor]


def sum_over_experts(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    product: ExpertProduct,
    every_expert: bool,
    held: range | None = None,
) -> torch.Tensor:
    """The routed experts' weighted sum for ``x: [T, H]`` (``topk_weights: [T, k]`` float32,
    ``topk_ids: [T, k]``, distinct experts per row). The tokens are grouped by the experts hit,
    read on the host (a sync); with ``every_expert`` (no sync, for CUDA graphs) every expert
    runs on every token and adds its product at weight zero where not routed, which adds
    exactly nothing: the same sums. ``held``: the experts summed (a rank's share under expert
    parallelism; None: all), ``product`` called with their global indices."""
    out = torch.zeros_like(x)
    experts = range(num_experts) if held is None else held
    if every_expert:
        for expert in experts:
            weight = (topk_weights * (topk_ids == expert)).sum(dim=-1, keepdim=True)  # [T, 1]
            out += (product(x, expert).float() * weight).to(x.dtype)
        return out
    hit = torch.bincount(topk_ids.flatten(), minlength=num_experts).nonzero()
    for expert in hit.flatten().tolist():
        if expert not in experts:
            continue
        token, slot = torch.where(topk_ids == expert)  # [n] each, token order
        weighted = product(x[token], expert).float() * topk_weights[token, slot].unsqueeze(-1)
        out.index_add_(0, token, weighted.to(x.dtype))
    return out
