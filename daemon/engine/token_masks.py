"""``TokenMasks``: grammar masks (daemon/grammar/) applied to the logits sampled rows choose
from (the adjusted copy: the logprobs stay the model's). A plain step's masks come in its
plan (``StepPlan.masks``); a drafting step's, one per verify node, from the host in the
middle of the step, once its drafts are known (runner.py).

Masks are int32 words, bit ``t`` of a row set where token ``t`` may come. They travel
through pinned host memory to the device and are unpacked there: a disallowed token's
logit becomes -inf. Steps with masks run eagerly and allocate them per step (torch's
caching allocators); the unpacking's temporaries (an int32 and a bool a logit of a masked
row) are freed before sampling's scratch is taken, inside the memory plan's
``SAMPLING_BYTES_PER_LOGIT``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_BITS = 32
# Given the grammar rows' drafts on the host (``[rows, W - 1]``) and a tree's parents (or
# None), their verify nodes' masks, row after row, node after node (daemon/grammar/).
NodeMasks = Callable[[torch.Tensor, torch.Tensor | None], bytes]


class TokenMasks:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._shifts = torch.arange(_BITS, dtype=torch.int32, device=device)

    def apply(self, choose: torch.Tensor, rows: list[int], masks: bytes) -> None:
        """Set to -inf, in ``choose`` (``[R, V']``), every logit of row ``rows[i]`` whose
        token mask ``i`` (of ``masks``) does not allow, tokens at or past the masks'
        vocabulary included."""
        n = len(rows)
        if not n:
            return
        pinned = self.device.type == "cuda"
        host = torch.frombuffer(bytearray(masks), dtype=torch.int32).view(n, -1)
        host_rows = torch.tensor(rows, dtype=torch.int64)
        if pinned:
            host, host_rows = host.pin_memory(), host_rows.pin_memory()
        words = host.to(self.device, non_blocking=True)
        index = host_rows.to(self.device, non_blocking=True)
        bits = (words.unsqueeze(-1) >> self._shifts) & 1  # [n, words, 32]
        allowed = bits.view(n, -1)[:, : self.vocab_size].bool()
        width = choose.shape[1]
        if width > self.vocab_size:
            allowed = torch.nn.functional.pad(allowed, (0, width - self.vocab_size))
        picked = choose.index_select(0, index)
        choose.index_copy_(0, index, picked.masked_fill(~allowed[:, :width], float("-inf")))
