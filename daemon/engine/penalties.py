"""Logit adjustments a request asks for, on the target's logits before the sampling rule
(plugins/sampling.py), in this order:

1. ``logit_bias``: ``bias[t]`` added to token ``t``'s logit;
2. ``repetition_penalty`` ``r`` (1: off): a token of the prompt or of the output so far has its
   logit divided by ``r`` when positive, multiplied by ``r`` otherwise;
3. ``frequency_penalty`` ``f`` and ``presence_penalty`` ``p``: token ``t``'s logit minus
   ``f * count(t) + p * [count(t) > 0]``, ``count`` over the output so far.

The output so far, at a position, is every token committed before it and, at a verify node,
the drafts on its path from the root (the tokens a target-only decode would have committed
first): each node sees the logits a decode without speculation sees there, so verification
stays lossless (greedy: token for token; sampled: the same draws). Logprobs stay the raw
log-softmax; rows that ask for nothing get their logits back unchanged.

The counts come from ``TokenHistory``, the committed tokens laid out like the KV pool:
prefix-cache pages carry their tokens, since the request that computed a page wrote them.
A row with KV length ``kv_len`` (its root, the last committed token, not yet in the KV) and
``out_len`` output tokens has its prompt at positions ``0 .. kv_len - out_len`` and its
output after, the root last.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from outrider.plugins.device import KVCache, flat_kv_index

if TYPE_CHECKING:
    from outrider.daemon.engine.slots import RelayRows, SlotState


@dataclass(frozen=True)
class LogitAdjust:
    """Per-row adjustment parameters, on the logits' device."""

    presence: torch.Tensor  # [n] float32; 0: off
    frequency: torch.Tensor  # [n] float32; 0: off
    repetition: torch.Tensor  # [n] float32; 1: off
    bias_ids: torch.Tensor  # [n, B] int64 (unused entries: id 0, bias 0)
    bias_values: torch.Tensor  # [n, B] float32


@dataclass(frozen=True)
class Seen:
    """What a row has produced and read, before the position its logits predict."""

    counts: torch.Tensor  # [n, V] int32: output tokens
    prompt: torch.Tensor  # [n, V] bool: tokens of the prompt


class TokenHistory:
    """The token at every KV position of every row (``-1`` where none was written), written by
    every step: an EXTEND chunk's inputs, and a decode step's committed tokens."""

    BYTES_PER_TOKEN = 8  # beside each token's KV (memory_plan.py)

    def __init__(self, kv_positions: int, device: torch.device) -> None:
        self.tokens = torch.full((kv_positions,), -1, dtype=torch.int64, device=device)

    def write(self, flat_index: torch.Tensor, tokens: torch.Tensor) -> None:
        """Tokens at flat KV indices (``flat_kv_index``), both of one shape."""
        self.tokens.index_copy_(0, flat_index.reshape(-1), tokens.reshape(-1))

    def seen(
        self,
        page_table: torch.Tensor,
        page_size: int,
        slots: torch.Tensor,
        kv_lens: torch.Tensor,
        out_lens: torch.Tensor,
        max_kv: int,
        vocab: int,
        roots: torch.Tensor | None,
    ) -> Seen:
        """The counts of rows in ``slots`` whose first ``kv_lens`` positions hold their text
        and which committed ``out_lens`` tokens; ``roots``: each row's last committed token,
        not in the KV yet (None: the text ends at ``kv_lens``, an EXTEND row whose prompt
        just ended). ``max_kv`` bounds every ``kv_lens``."""
        n = slots.shape[0]
        positions = torch.arange(max_kv, device=slots.device).expand(n, max_kv)
        index = flat_kv_index(page_table, slots.unsqueeze(1), positions, page_size)
        tokens = self.tokens[index]  # [n, max_kv]
        written = positions < kv_lens.unsqueeze(1)
        first_output = kv_lens + (0 if roots is None else 1) - out_lens
        output = written & (positions >= first_output.unsqueeze(1))
        prompt = written & ~output
        # Entries that do not count land in a spare column V, dropped after.
        spare = torch.full_like(tokens, vocab)
        ones = torch.ones((n, max_kv), dtype=torch.int32, device=slots.device)
        counts = torch.zeros((n, vocab + 1), dtype=torch.int32, device=slots.device)
        counts.scatter_add_(1, torch.where(output, tokens, spare), ones)
        if roots is not None:
            counts.scatter_add_(1, roots.unsqueeze(1), ones[:, :1])
        in_prompt = torch.zeros((n, vocab + 1), dtype=torch.bool, device=slots.device)
        in_prompt.scatter_(1, torch.where(prompt, tokens, spare), True)
        return Seen(counts[:, :vocab], in_prompt[:, :vocab])


def adjusted_logits(
    logits: torch.Tensor,
    adjust: LogitAdjust,
    seen: Seen,
    path: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The adjusted logits of ``logits: [n, W, V]`` (``W`` nodes a row: 1 without drafts).
    ``path``: (``tokens [n, W]``, ``visible [n, W, W]``) when rows verify drafts: node ``j``'s
    output also holds the tokens of the nodes ``i >= 1`` that ``visible[:, j, i]`` marks (its
    ancestors and itself; node 0 is the root, already counted in ``seen``)."""
    n, width, vocab = logits.shape
    biased = logits.float().clone()
    bias_ids = adjust.bias_ids.unsqueeze(1).expand(n, width, -1)
    biased.scatter_add_(2, bias_ids, adjust.bias_values.unsqueeze(1).expand(n, width, -1))
    rep, freq, pres = (
        p.view(n, 1, 1) for p in (adjust.repetition, adjust.frequency, adjust.presence)
    )
    counts, prompt = seen.counts.unsqueeze(1), seen.prompt.unsqueeze(1)  # [n, 1, V]
    if path is None or width == 1:
        return _penalized(biased, counts, prompt, rep, freq, pres)
    # A spare column V takes the writes that must not land (dropped at the end).
    out = torch.empty((n, width, vocab + 1), dtype=torch.float32, device=logits.device)
    out[..., :vocab] = _penalized(biased, counts, prompt, rep, freq, pres)
    tokens, visible = path
    on_path = visible.clone()  # [n, W(j), W(i)]: node i is on node j's path
    on_path[:, :, 0] = False  # the root is counted already
    same = tokens.unsqueeze(2) == tokens.unsqueeze(1)  # [n, W, W]: nodes of one token
    # Node j's count of node k's token adds the nodes on j's path that carry it.
    extra = torch.einsum("nji,nki->njk", on_path.float(), same.float()).to(torch.int32)
    # Node j's logit of a token on its path is rewritten once: at its first path node k.
    earlier = torch.ones(width, width, dtype=torch.bool, device=logits.device).tril(-1)
    repeated = ((same & earlier).unsqueeze(1) & on_path.unsqueeze(2)).any(dim=3)
    first = on_path & ~repeated  # [n, W(j), W(k)]
    index = tokens.unsqueeze(1).expand(n, width, width)  # [n, j, k]: node k's token
    fixed = _penalized(
        biased.gather(2, index),
        counts.expand(n, width, vocab).gather(2, index) + extra,
        prompt.expand(n, width, vocab).gather(2, index),
        rep, freq, pres,
    )  # fmt: skip
    out.scatter_(2, torch.where(first, index, vocab), fixed)
    return out[..., :vocab]


def _penalized(
    x: torch.Tensor,
    counts: torch.Tensor,
    prompt: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """Rules 2 and 3 on logits ``x`` given each token's output count and prompt presence
    (all broadcast together)."""
    produced = counts > 0
    repeated = torch.where(x > 0, x / repetition, x * repetition)
    x = torch.where(produced | prompt, repeated, x)
    return x - frequency * counts - presence * produced


class Adjuster:
    """Keeps the token history of every step and adjusts the logits of the steps whose plan
    asks for it (``StepPlan.adjusts``)."""

    def __init__(self, kv: KVCache, slots: SlotState, device: torch.device) -> None:
        self.history = TokenHistory(kv.num_pages * kv.page_size, device)
        self.page_size = kv.page_size
        self.slots = slots

    def _index(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return flat_kv_index(self.slots.page_table, slots, positions, self.page_size)

    def wrote_extend(self, out_loc: torch.Tensor, input_ids: torch.Tensor) -> None:
        """An EXTEND chunk's tokens at their KV slots."""
        self.history.write(out_loc, input_ids)

    def committed(
        self, slots: torch.Tensor, starts: torch.Tensor, roots: torch.Tensor, tokens: torch.Tensor
    ) -> None:
        """A decode step committed ``tokens: [bs, m]`` after each row's root (its first
        ``commit_len``): the root and all but the last land at ``starts ..``, where the KV of
        those tokens now is. Entries past a row's commit length write positions its next step
        overwrites before any read."""
        block = torch.cat([roots.unsqueeze(1), tokens[:, :-1]], dim=1)  # [bs, m]
        positions = starts.unsqueeze(1) + torch.arange(block.shape[1], device=block.device)
        self.history.write(self._index(slots.unsqueeze(1), positions), block)

    def extend_logits(
        self, logits: torch.Tensor, slots: torch.Tensor, kv_lens: torch.Tensor, max_kv: int
    ) -> torch.Tensor:
        """``logits: [n, V]`` of EXTEND rows whose prompt of ``kv_lens`` tokens just ended."""
        out = torch.empty_like(logits, dtype=torch.float32)
        for rows in _passes(slots.shape[0], 1):
            seen = self.history.seen(
                self.slots.page_table, self.page_size, slots[rows], kv_lens[rows],
                torch.zeros_like(kv_lens[rows]), max_kv, logits.shape[-1], None,
            )  # fmt: skip
            adjust = self.slots.adjust(slots[rows])
            out[rows] = adjusted_logits(logits[rows].unsqueeze(1), adjust, seen)[:, 0]
        return out

    def decode_logits(
        self,
        logits: torch.Tensor,
        slots: torch.Tensor,
        relay: RelayRows,
        max_kv: int,
        path: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``logits: [bs * W, V]`` of a decode batch (``W`` nodes a row; ``path`` as
        ``adjusted_logits`` takes it when ``W > 1``), adjusted: the same shape."""
        bs, vocab = slots.shape[0], logits.shape[-1]
        nodes = logits.view(bs, -1, vocab)
        out = torch.empty(nodes.shape, dtype=torch.float32, device=logits.device)
        for rows in _passes(bs, nodes.shape[1]):
            seen = self.history.seen(
                self.slots.page_table, self.page_size, slots[rows], relay.starts[rows],
                relay.out_lens[rows], max_kv, vocab, relay.roots[rows],
            )  # fmt: skip
            adjust = self.slots.adjust(slots[rows])
            row_path = None if path is None else (path[0][rows], path[1][rows])
            out[rows] = adjusted_logits(nodes[rows], adjust, seen, row_path)
        return out.view(-1, vocab)


# Logit rows (batch rows times nodes) adjusted in one pass: the rules' temporaries, a few
# logits-sized tensors each, stay this small whatever the batch; the adjusted logits are one
# float32 copy of the batch's (step_memory.py budgets it).
ROWS_PER_PASS = 64


def _passes(rows: int, width: int) -> list[slice]:
    """Slices of ``rows`` batch rows of ``width`` logit rows each, ``ROWS_PER_PASS`` logit rows
    a pass (at least one batch row)."""
    step = max(1, ROWS_PER_PASS // width)
    return [slice(i, min(i + step, rows)) for i in range(0, rows, step)]
