"""``GrammarState``: one request's place in its grammar."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xgrammar as xgr


class GrammarState:
    def __init__(self, compiled: xgr.CompiledGrammar, stop_ids: Sequence[int]) -> None:
        self._matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_ids))
        self.vocab_size: int = compiled.tokenizer_info.vocab_size

    def fill(self, masks: torch.Tensor, row: int) -> None:
        """Row ``row`` of ``masks`` (int32 ``[rows, ceil(V / 32)]``, on the CPU): bit ``t``
        set where token ``t`` may come next."""
        self._matcher.fill_next_token_bitmask(masks, row)

    def advance(self, tokens: Sequence[int]) -> bool:
        """Take the request's newly committed ``tokens``; False when the grammar refuses one
        (none is taken after it)."""
        return all(self._matcher.accept_token(token) for token in tokens)

    @property
    def ended(self) -> bool:
        """The grammar has taken a stop token: nothing may follow."""
        return bool(self._matcher.is_terminated())


def pack_masks(states: Sequence[GrammarState]) -> bytes:
    """The masks of ``states`` (one vocabulary), as ``StepPlan.masks`` carries them."""
    masks = xgr.allocate_token_bitmask(len(states), states[0].vocab_size)
    for row, state in enumerate(states):
        state.fill(masks, row)
    return masks.numpy().tobytes()
