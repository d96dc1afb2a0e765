"""``TokenMasks``: a plan's grammar masks (``StepPlan.masks``) applied to the logits its
masked rows choose from (the adjusted copy: the logprobs stay the model's).

The masks arrive as bytes in the plan, go through one of two pinned staging buffers (one
per step in flight, as the step inputs do) into a fixed device buffer, and are unpacked
there: a disallowed token's logit becomes -inf. The unpacking's temporaries (an int32 and a
bool a logit of a masked row) are freed before sampling's scratch is taken, inside the
memory plan's ``SAMPLING_BYTES_PER_LOGIT``.
"""

from __future__ import annotations

import torch

from outrider.daemon.engine.plan import StepPlan

_BITS = 32


def mask_words(vocab_size: int) -> int:
    """int32 words a row's mask takes."""
    return -(-vocab_size // _BITS)


class TokenMasks:
    def __init__(self, max_rows: int, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        words = mask_words(vocab_size)
        pinned = device.type == "cuda"
        self._staging = [
            torch.zeros(max_rows, words, dtype=torch.int32, pin_memory=pinned) for _ in range(2)
        ]
        self._staged_rows = [
            torch.zeros(max_rows, dtype=torch.int64, pin_memory=pinned) for _ in range(2)
        ]
        self._turn = 0
        self._masks = torch.zeros(max_rows, words, dtype=torch.int32, device=device)
        self._rows = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self._shifts = torch.arange(_BITS, dtype=torch.int32, device=device)

    def apply(self, choose: torch.Tensor, plan: StepPlan) -> None:
        """Set to -inf, in ``choose`` (``[len(plan.sample_rows), V']``), every logit of a
        masked row whose token its grammar does not allow (tokens at or past the mask's
        vocabulary included)."""
        n = len(plan.masked_rows)
        if not n:
            return
        staging, staged_rows = self._staging[self._turn], self._staged_rows[self._turn]
        self._turn ^= 1
        staging[:n].copy_(torch.frombuffer(bytearray(plan.masks), dtype=torch.int32).view(n, -1))
        staged_rows[:n].copy_(torch.tensor(plan.masked_rows, dtype=torch.int64))
        masks, rows = self._masks[:n], self._rows[:n]
        masks.copy_(staging[:n], non_blocking=True)
        rows.copy_(staged_rows[:n], non_blocking=True)
        bits = (masks.unsqueeze(-1) >> self._shifts) & 1  # [n, words, 32]
        allowed = bits.view(n, -1)[:, : self.vocab_size].bool()
        width = choose.shape[1]
        if width > self.vocab_size:
            allowed = torch.nn.functional.pad(allowed, (0, width - self.vocab_size))
        picked = choose.index_select(0, rows)
        choose.index_copy_(0, rows, picked.masked_fill(~allowed[:, :width], float("-inf")))
