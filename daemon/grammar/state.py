"""``GrammarState``: one request's place in its grammar; ``RowGrammars``: the states of a
decode plan's grammar rows, which give the host's masks in the middle of the step (the
engine's ``GrammarRows``, engine/token_masks.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

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

    def node_masks(
        self, masks: torch.Tensor, first: int, tokens: list[int], parents: list[int] | None
    ) -> int:
        """Rows ``first ..`` of ``masks``: the mask of each verify node of a draft, node 0
        the root (this state), node ``i`` after the path root -> ``i`` (``tokens[i - 1]``
        the token of node ``i``, ``parents[i - 1]`` its parent's index; a chain's parent is
        the node before). A node is reached when its parent is and its parent's mask allows
        its token; one that is not, or that follows the grammar's end, is never committed
        and takes its parent's mask, so that no row is all masked. Returns how many nodes
        the grammar refused (reached parents whose masks refuse their tokens)."""
        self.fill(masks, first)
        live = [True]  # per node: reached, and the grammar not ended there
        refused = 0
        for node in range(1, len(tokens) + 1):
            parent = node - 1 if parents is None else parents[node - 1]
            token = tokens[node - 1]
            allowed = live[parent] and _allows(masks[first + parent], token)
            refused += live[parent] and not allowed
            live.append(allowed and self._fill_after(masks, first + node, node, tokens, parents))
            if not live[node]:
                masks[first + node] = masks[first + parent]
        return refused

    def path_mask(self, masks: torch.Tensor, row: int, path: list[int]) -> None:
        """Row ``row`` of ``masks``: the mask after ``path`` (tokens from this state); every
        token allowed where the grammar refuses one of the path or ends on it (such a place
        is never committed). The matcher is back at this state after."""
        taken = 0
        for token in path:
            if not self._matcher.accept_token(token):
                break
            taken += 1
        if taken == len(path) and not self._matcher.is_terminated():
            self.fill(masks, row)
        else:
            masks[row] = -1  # every bit set
        self._matcher.rollback(taken)

    def _fill_after(
        self,
        masks: torch.Tensor,
        row: int,
        node: int,
        tokens: list[int],
        parents: list[int] | None,
    ) -> bool:
        """Row ``row``: the mask after the path to ``node`` (each of its tokens allowed
        where it stands); False, and the row untouched, where the grammar ended on the way.
        The matcher is back at this state after."""
        path = _path_to(node, parents)
        for step in path:
            # Allowed by the mask before it, so accepted: only a stop token ends the grammar.
            self._matcher.accept_token(tokens[step - 1])
        going_on = not self._matcher.is_terminated()
        if going_on:
            self.fill(masks, row)
        self._matcher.rollback(len(path))
        return going_on


def pack_masks(states: Sequence[GrammarState], ended: Sequence[bool] = ()) -> bytes:
    """The masks of ``states`` (one vocabulary), as ``StepPlan.masks`` carries them; a row
    whose ``ended`` is set (its request finished: its draw is dropped) allows every token. One
    row after the other: xgrammar's ``BatchGrammarMatcher`` took 4.0 ms for 32 rows on a
    16-core host where one row takes 8 us (BENCHMARKS.md, structured output)."""
    masks = xgr.allocate_token_bitmask(len(states), states[0].vocab_size)  # every bit set
    for row, state in enumerate(states):
        if not (ended and ended[row]):
            state.fill(masks, row)
    return masks.numpy().tobytes()


def _allows(mask: torch.Tensor, token: int) -> bool:
    """Whether row ``mask`` (int32 words) lets ``token`` through."""
    if token >> 5 >= mask.shape[0]:
        return False
    return bool((int(mask[token >> 5]) >> (token & 31)) & 1)


def _path_to(node: int, parents: list[int] | None) -> list[int]:
    """The nodes from the root's child down to ``node`` (the root, 0, left out)."""
    path = []
    while node:
        path.append(node)
        node = node - 1 if parents is None else parents[node - 1]
    return path[::-1]


class Owner(Protocol):
    """What a row's mask needs of its request: whether it finished."""

    @property
    def finished(self) -> bool: ...


@dataclass(frozen=True)
class RowGrammars:
    """The states of a decode plan's grammar rows, in plan order, with their requests (a row
    whose request finished allows every token: its draw is dropped)."""

    states: Sequence[GrammarState]
    owners: Sequence[Owner] = ()  # one a state; none: no request finished

    def masks(self) -> bytes:
        """Each row's next mask from its state now."""
        return pack_masks(self.states, self._ended())

    def node_masks(self, tokens: torch.Tensor, parents: torch.Tensor | None) -> bytes:
        """The verify-node masks of each row (its drafts ``tokens[r]``, a tree's
        ``parents[r]``: host tensors ``[rows, width - 1]``), row after row, node after node."""
        width = tokens.shape[1] + 1
        masks = xgr.allocate_token_bitmask(len(self.states) * width, self.states[0].vocab_size)
        for row, (state, ended) in enumerate(zip(self.states, self._ended(), strict=True)):
            if not ended:
                shape = None if parents is None else parents[row].tolist()
                state.node_masks(masks, row * width, tokens[row].tolist(), shape)
        return masks.numpy().tobytes()

    def path_masks(self, paths: torch.Tensor) -> bytes:
        """The mask at each draft place of each row (``paths[r, i]``: the tokens drafted
        before place ``i``; a host tensor ``[rows, n, d]``), row after row, place after
        place."""
        rows, n, _ = paths.shape
        masks = xgr.allocate_token_bitmask(rows * n, self.states[0].vocab_size)
        for row, (state, ended) in enumerate(zip(self.states, self._ended(), strict=True)):
            for place in range(n if not ended else 0):
                state.path_mask(masks, row * n + place, paths[row, place].tolist())
        return masks.numpy().tobytes()

    def _ended(self) -> list[bool]:
        """Per row: its request finished (its masks allow every token)."""
        if not self.owners:
            return [False] * len(self.states)
        return [owner.finished for owner in self.owners]
