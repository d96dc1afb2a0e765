"""``GrammarState``: one request's place in its grammar; ``RowGrammars``: the states of a
decode plan's grammar rows, which give the host's masks in the middle of the step (the
engine's ``GrammarRows``, engine/token_masks.py)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from time import perf_counter
from typing import Protocol

import numpy as np
import torch
import xgrammar as xgr


class GrammarState:
    """One request's matcher. Invariant: the matcher stands at the committed tokens plus
    ``_ahead``, tokens a walk took past them (a draft path, kept so that the next walk, or
    the commit, starts from the longest prefix they share); ``_masks`` holds the masks after
    the root and the draft places' paths walked since the last commit (None: the path is
    refused or ends the grammar), so that a verify node reuses its draft place's mask (a
    node's own is read once and not kept). Masks are int32 words ``[rows,
    ceil(V / 32)]`` on the CPU; rows are copied, and bits read, through a numpy view
    (``_word_view``): torch's indexing costs microseconds a call.

    Free text: where a mask allows more than ``FREE_TEXT`` of the vocabulary (inside a
    string), a draft's own choice is almost always allowed and a mask costs the most
    (about 15 us against a real 129,280-id tokenizer, 1-15 us at a structural place;
    100-300 us against a small one widened to 128k by copies of its pieces): a draft
    place below one whose mask is free text takes no mask, nor do the places below it in
    that step (where the committed state's is, every place past the first:
    ``guides_paths``), and the verify nodes, whose masks fill while the verify's forward
    runs, mask those paths.
    A tree's depth has several places, best first: those past its best ``GUIDED_PLACES``
    (the best alone in a step of more than ``GUIDED_PLACES_ROWS`` grammar rows:
    ``depth_guided``) take no mask, nor do the places below them (the verify nodes mask
    them).
    Free text goes on while the tokens committed hold none of ``exits`` (a JSON string
    ends at a quotation mark, an escape starts at a backslash): such a step's first place
    takes no mask either, and its root's mask is filled with the verify nodes'; that mask
    decides the step after, so free text that ended otherwise (another grammar's) costs one
    step's guidance at most.

    Cost: each fill is timed; a state whose fills took longer than its limit on the mean of
    each of ``COSTLY_STEPS`` committed steps in a row is ``too_costly`` (its request ends:
    the step of every row waits for its masks)."""

    def __init__(
        self,
        compiled: xgr.CompiledGrammar,
        stop_ids: Sequence[int],
        exits: np.ndarray | None = None,
        mask_limit_ms: float = 0.0,
    ) -> None:
        """``exits``: per token id, whether its text may leave free text
        (``Grammars.text_exits``); None: every step's first place takes its mask.
        ``mask_limit_ms``: the mean time a step's fills may take (``too_costly``; 0: any)."""
        self._matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_ids))
        self.mask_limit_ms = mask_limit_ms
        self._fill_seconds = 0.0  # the fills since the last commit, and their time
        self._fills = 0
        self._costly = 0  # committed steps in a row whose fills were over the limit
        self._cost_ms = 0.0  # the last such step's mean fill
        self.vocab_size: int = compiled.tokenizer_info.vocab_size
        self._exits = exits
        self._stops = frozenset(stop_ids)
        self._ended = False  # the committed tokens end the grammar (its stop token taken)
        self._ahead: tuple[int, ...] = ()
        self._masks: dict[tuple[int, ...], np.ndarray | None] = {}
        self._still_free = False  # free text at the last root, no exit committed since
        # This step's paths whose masks were judged (free text or not), once asked; the
        # draft places left unguided, and the last depth's masked ones (None: no place yet).
        self._free: dict[tuple[int, ...], bool] = {}
        self._unguided: set[tuple[int, ...]] = set()
        self._depth: list[tuple[int, ...]] | None = None

    def fill(self, masks: torch.Tensor, row: int) -> None:
        """Row ``row`` of ``masks`` (int32 ``[rows, ceil(V / 32)]``, on the CPU): bit ``t``
        set where token ``t`` may come next."""
        self._walk(())  # a request whose grammar ended has finished: its mask is not read
        self._fill(masks, row)

    def advance(self, tokens: Sequence[int]) -> bool:
        """Take the request's newly committed ``tokens``; False when the grammar refuses one
        (none is taken after it)."""
        kept = _shared(self._ahead, tokens)
        if kept < len(self._ahead):
            self._matcher.rollback(len(self._ahead) - kept)
        if kept:
            self._ended = tokens[kept - 1] in self._stops
        self._still_free = (
            self._exits is not None
            and () in self._masks
            and self._free_at(())
            and not any(self._exits[token] for token in tokens)
        )
        self._ahead = ()
        self._masks.clear()
        self._free.clear()
        self._unguided.clear()
        self._depth = None
        self._judge_cost()
        for token in tokens[kept:]:
            if self._ended or not self._matcher.accept_token(token):
                return False
            self._ended = token in self._stops
        return True

    def too_costly(self) -> float | None:
        """The mean time of a fill (ms) over the last of ``COSTLY_STEPS`` committed steps in
        a row whose fills took longer than ``mask_limit_ms`` on their mean; None while not
        so (or without a limit)."""
        return self._cost_ms if self._costly >= COSTLY_STEPS else None

    def _judge_cost(self) -> None:
        """At a commit: the step's fills against the limit (a step without fills changes
        nothing)."""
        if self._fills and self.mask_limit_ms:
            self._cost_ms = 1e3 * self._fill_seconds / self._fills
            self._costly = self._costly + 1 if self._cost_ms > self.mask_limit_ms else 0
        self._fill_seconds, self._fills = 0.0, 0

    def _fill(self, masks: torch.Tensor, row: int) -> None:
        """Row ``row`` of ``masks``: the matcher's next mask, timed."""
        start = perf_counter()
        self._matcher.fill_next_token_bitmask(masks, row)
        self._fill_seconds += perf_counter() - start
        self._fills += 1

    def node_masks(
        self,
        masks: torch.Tensor,
        first: int,
        tokens: list[int],
        parents: list[int] | None,
        words: np.ndarray | None = None,
    ) -> int:
        """Rows ``first ..`` of ``masks``: the mask of each verify node of a draft, node 0
        the root (this state), node ``i`` after the path root -> ``i`` (``tokens[i - 1]``
        the token of node ``i``, ``parents[i - 1]`` its parent's index; a chain's parent is
        the node before). A node is reached when its parent is and its parent's mask allows
        its token; one that is not, or that follows the grammar's end, is never committed
        and takes its parent's mask, so that no row is all masked. Returns how many nodes
        the grammar refused (reached parents whose masks refuse their tokens). ``words``:
        ``masks``' numpy view, where the caller has it (a view costs microseconds)."""
        words = _word_view(masks) if words is None else words
        self._mask_after((), masks, words, first)  # the root: always reached
        paths: list[tuple[int, ...]] = [()]
        live = [True]  # per node: reached, and the grammar not ended there
        refused = 0
        for node in range(1, len(tokens) + 1):
            parent = node - 1 if parents is None else parents[node - 1]
            token = tokens[node - 1]
            paths.append((*paths[parent], token))
            allowed = live[parent] and _allows(words[first + parent], token)
            refused += live[parent] and not allowed
            reached = allowed and self._mask_after(
                paths[node], masks, words, first + node, keep=False
            )
            live.append(reached)
            if not live[node]:
                words[first + node] = words[first + parent]
        return refused

    def place_masks(
        self,
        masks: torch.Tensor,
        first: int,
        paths: Sequence[Sequence[int]],
        words: np.ndarray | None = None,
        guided: int | None = None,
    ) -> None:
        """Rows ``first ..`` of ``masks``: the masks of a step's draft places at one depth,
        place ``p`` after ``paths[p]`` (tokens from the committed state); every token
        allowed where the grammar refuses a token of the path or ends on it (such a place is
        never committed), and where the place is not guided: past the depth's ``guided``
        best (``paths`` best first; None: ``GUIDED_PLACES``; ``depth_guided``), below a
        place of this step left so or whose mask is free text, past the first place where
        the committed state's is, and at the first while the root's mask is not known and
        free text goes on (class docstring). ``words``: as ``node_masks``'."""
        words = _word_view(masks) if words is None else words
        guided = GUIDED_PLACES if guided is None else guided
        root_guided = self._root_guided()  # the first depth has one place: holds for the call
        self._depth = []
        for place, path in enumerate(paths):
            key = tuple(path)
            if (
                place >= guided
                or (not root_guided and (bool(key) or () not in self._masks))
                or (bool(key) and (key[:-1] in self._unguided or self._free_at(key[:-1])))
            ):
                self._unguided.add(key)
            elif self._mask_after(key, masks, words, first + place):
                self._depth.append(key)
                continue
            words[first + place] = _EVERY

    def guides_paths(self) -> bool:
        """Whether this step's next draft places take masks: not where the committed state's
        mask, once known (the first place's, or the root node's), is free text, nor, while it
        is not known, where free text goes on, nor below a depth whose places all went
        unguided, were refused or reached free text (class docstring)."""
        if not self._root_guided():
            return False
        return self._depth is None or not all(self._free_at(key) for key in self._depth)

    def _root_guided(self) -> bool:
        if () not in self._masks:
            return not self._still_free
        return not self._free_at(())

    def _free_at(self, path: tuple[int, ...]) -> bool:
        """Whether the mask after ``path`` is free text (not where it is not known or the
        grammar refuses the path): it allows more than ``FREE_TEXT`` of the vocabulary,
        judged from ``_FREE_SAMPLE_WORDS`` words or so spread over it (a structural mask
        allows a handful of tokens, free text nearly all: against a 128k vocabulary the
        sample tells them apart at a third of a full count's cost); judged once a step,
        when first asked."""
        free = self._free.get(path)
        if free is None:
            if path not in self._masks:
                return False
            mask = self._masks[path]
            free = False
            if mask is not None:
                sample = mask[:: max(1, mask.shape[0] // _FREE_SAMPLE_WORDS)]
                # One integer's popcount: a numpy reduction costs microseconds a call.
                allowed = int.from_bytes(sample.tobytes(), "little").bit_count()
                free = allowed > FREE_TEXT * 32 * sample.shape[0]
            self._free[path] = free
        return free

    def _mask_after(
        self,
        path: tuple[int, ...],
        masks: torch.Tensor,
        words: np.ndarray,
        row: int,
        keep: bool = True,
    ) -> bool:
        """Row ``row`` of ``masks`` (``words``: its numpy view): the mask after ``path``,
        walked once a commit where ``keep`` (a verify node's is read once: not kept, its
        copy about a sixth of its cost); False, and the row untouched, where the grammar
        refuses a token of it or ends on the way."""
        if path in self._masks:
            known = self._masks[path]
            if known is not None:
                words[row] = known
            return known is not None
        reached = self._walk(path)
        if reached:
            self._fill(masks, row)
        if keep:
            self._masks[path] = words[row].copy() if reached else None
        return reached

    def _walk(self, path: tuple[int, ...]) -> bool:
        """Bring the matcher to ``path`` past the committed tokens, from the longest prefix
        it shares with where the matcher stands; whether the whole path was taken and the
        grammar goes on after it (the empty path: always). The grammar has ended once it
        took a stop token (the matcher's own ``is_terminated``, read without a call)."""
        ahead = self._ahead
        kept = len(ahead)
        if path[:kept] != ahead:  # not a step further down the path walked last
            kept = _shared(ahead, path)
            self._matcher.rollback(len(ahead) - kept)
            ahead = ahead[:kept]
        ended = ahead[-1] in self._stops if ahead else self._ended
        for token in path[kept:]:
            if ended or not self._matcher.accept_token(token):
                self._ahead = ahead
                return False
            ahead += (token,)
            ended = token in self._stops
        self._ahead = ahead
        return not path or not ended


def pack_masks(states: Sequence[GrammarState]) -> bytes:
    """The masks of ``states`` (one vocabulary), as ``StepPlan.masks`` carries them."""
    masks = xgr.allocate_token_bitmask(len(states), states[0].vocab_size)
    RowGrammars(states).masks(masks, range(len(states)))
    return masks.numpy().tobytes()


def _shared(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of ``a`` and ``b``."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


_EVERY = 0xFFFFFFFF  # a mask word allowing every token
# Committed steps in a row over a state's mask limit before it is too costly: a single slow
# step (the host busy elsewhere) is forgiven.
COSTLY_STEPS = 3
# The places of a tree's depth that take masks, best first (GrammarState.place_masks): on the
# embedded family's trained EAGLE-3 tree (top-4, 8 nodes; 3, 4 and 5 steps deep) guiding the
# two best gave the acceptance of guiding all four, the best alone 1.7-8 % less
# (BENCHMARKS.md); the guide's fills wait between the draft's forwards. The second place
# costs the H200's host about 0.04 ms a grammar row a depth: past two rows, more than it
# buys on a tree of five steps (a turn of about 8 ms), so the best alone is guided there.
GUIDED_PLACES = 2
GUIDED_PLACES_ROWS = 2


def depth_guided(grammar_rows: int) -> int:
    """How many of a tree depth's best places take masks in a step of ``grammar_rows``."""
    return GUIDED_PLACES if grammar_rows <= GUIDED_PLACES_ROWS else 1


# The share of the vocabulary a mask allows past which its state is free text (GrammarState):
# a string's inside allows nearly every token, a structural place a few.
FREE_TEXT = 0.5
_FREE_SAMPLE_WORDS = 256  # mask words that judge free text (GrammarState._free_at)


def _word_view(masks: torch.Tensor) -> np.ndarray:
    """``masks`` as unsigned words, sharing its memory."""
    return masks.numpy().view(np.uint32)


def _allows(mask: np.ndarray, token: int) -> bool:
    """Whether row ``mask`` (words) lets ``token`` through."""
    if token >> 5 >= mask.shape[0]:
        return False
    return bool((int(mask[token >> 5]) >> (token & 31)) & 1)


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

    def masks(self, out: torch.Tensor, rows: Sequence[int]) -> None:
        """Row ``rows[i]`` of ``out`` (int32 words ``[n, ceil(V / 32)]``, on the CPU):
        grammar row ``i``'s next mask from its state now."""
        for i, row in self._live(out, rows, 1):
            self.states[i].fill(out, row)

    def node_masks(
        self,
        out: torch.Tensor,
        firsts: Sequence[int],
        tokens: torch.Tensor,
        parents: torch.Tensor | None,
    ) -> None:
        """Rows ``firsts[i] ..`` of ``out``: the masks of grammar row ``i``'s verify nodes,
        node after node (its drafts ``tokens[i]``, a tree's ``parents[i]``: host tensors
        ``[rows, width - 1]``)."""
        drafts, words = tokens.tolist(), _word_view(out)
        shapes = None if parents is None else parents.tolist()
        for i, first in self._live(out, firsts, tokens.shape[1] + 1):
            shape = None if shapes is None else shapes[i]
            self.states[i].node_masks(out, first, drafts[i], shape, words)

    def guides_paths(self) -> bool:
        """Whether some row whose request goes on guides its draft places
        (``GrammarState.guides_paths``)."""
        ended = self._ended()
        return any(
            state.guides_paths() for state, end in zip(self.states, ended, strict=True) if not end
        )

    def path_masks(self, out: torch.Tensor, firsts: Sequence[int], paths: torch.Tensor) -> None:
        """Rows ``firsts[i] ..`` of ``out``: the mask at each draft place of grammar row
        ``i``, place after place (``paths[i, p]``: the tokens drafted before place ``p``; a
        host tensor ``[rows, n, d]``)."""
        places, words = paths.tolist(), _word_view(out)
        guided = depth_guided(len(self.states))
        for i, first in self._live(out, firsts, paths.shape[1]):
            self.states[i].place_masks(out, first, places[i], words, guided)

    def _live(
        self, out: torch.Tensor, firsts: Sequence[int], span: int
    ) -> Iterator[tuple[int, int]]:
        """``(i, firsts[i])`` of each grammar row whose request has not finished; a finished
        one's ``span`` rows of ``out`` allow every token (its draw is dropped)."""
        for i, (first, end) in enumerate(zip(firsts, self._ended(), strict=True)):
            if end:
                out[first : first + span] = -1
            else:
                yield i, first

    def _ended(self) -> list[bool]:
        """Per grammar row, whether its request has finished."""
        return [owner.finished for owner in self.owners] or [False] * len(self.states)
