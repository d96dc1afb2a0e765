"""What the draft stages train and measure on: token sequences (prompt + the target's greedy
answer) and the frozen target's tapped features over them.

Training sequences are the ``regenerate`` stage's rows (train split only): the prompt rendered
through the chat template with the generation prompt, then ``answer_ids``. Held-out sequences
are a seeded sample of held-out conversations (the longest prefix ending with a user turn that
leaves room for ``new_tokens``) with the target's greedy continuation, cut after the first
``<|im_end|>``: what the daemon serves when it is asked for ``new_tokens`` at temperature 0.

Layer ids follow the output-of-layer convention: id ``L`` is the residual stream after decoder
layer ``L`` (0-based), Hugging Face's ``hidden_states[L + 1]``, before any final norm.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from recipe import data, model, regenerate

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

FORMS = ("messages", "prompt")  # how the held-out prompts are sent (chat template / raw text)
MAX_PROMPT_TOKENS = 256  # the family's held-out prompts: templated opening turns this short


@dataclass(frozen=True)
class Sequences:
    """Right-padded token rows: ``tokens[i, :prompt_lengths[i]]`` is the prompt and
    ``tokens[i, prompt_lengths[i]:lengths[i]]`` the target's answer."""

    tokens: torch.Tensor  # [N, T] int64, padded with PAD_ID
    prompt_lengths: torch.Tensor  # [N] int64
    lengths: torch.Tensor  # [N] int64

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def answer(self) -> torch.Tensor:
        """``[N, T]`` bool: the target generated this token."""
        columns = torch.arange(self.tokens.shape[1], device=self.tokens.device)
        return (columns >= self.prompt_lengths[:, None]) & (columns < self.lengths[:, None])

    def rows(self, index: torch.Tensor) -> Sequences:
        """The rows at ``index``, cut to their longest length."""
        lengths = self.lengths[index]
        width = int(lengths.max())
        return Sequences(self.tokens[index, :width], self.prompt_lengths[index], lengths)

    def to(self, device: str) -> Sequences:
        return Sequences(
            self.tokens.to(device), self.prompt_lengths.to(device), self.lengths.to(device)
        )


def from_pairs(prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]]) -> Sequences:
    width = max(len(p) + len(a) for p, a in zip(prompts, answers, strict=True))
    tokens = torch.full((len(prompts), width), model.PAD_ID, dtype=torch.int64)
    for row, (prompt, answer) in enumerate(zip(prompts, answers, strict=True)):
        tokens[row, : len(prompt) + len(answer)] = torch.tensor([*prompt, *answer])
    prompt_lengths = torch.tensor([len(p) for p in prompts], dtype=torch.int64)
    lengths = prompt_lengths + torch.tensor([len(a) for a in answers], dtype=torch.int64)
    return Sequences(tokens, prompt_lengths, lengths)


def regenerated(out: Path, tokenizer: PreTrainedTokenizerBase) -> Sequences:
    """The regenerate stage's rows with a non-empty answer. Raises ValueError if one of them
    comes from a held-out conversation."""
    heldout = {c.id for c in data.read_jsonl(out / "data" / data.HELDOUT)}
    prompts, answers = [], []
    path = out / "regenerate" / regenerate.REGENERATED
    with path.open(encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            if row["id"] in heldout:
                raise ValueError(f"{path}: {row['id']} is a held-out conversation")
            if row["answer_ids"]:
                prompts.append(regenerate.encode_prompt(tokenizer, row["messages"]))
                answers.append(row["answer_ids"])
    return from_pairs(prompts, answers)


def heldout_prompts(
    out: Path, tokenizer: PreTrainedTokenizerBase, count: int, max_prompt_tokens: int
) -> dict[str, list[list[int]]]:
    """The first ``count`` held-out conversations (file order) whose opening user turn,
    rendered through the chat template with the generation prompt, takes at most
    ``max_prompt_tokens``: per form, ``messages`` (that rendering) and ``prompt`` (the turn's
    raw text, as the front door encodes ``prompt=``)."""
    forms: dict[str, list[list[int]]] = {form: [] for form in FORMS}
    for conversation in data.read_jsonl(out / "data" / data.HELDOUT):
        first = conversation.messages[0]
        templated = regenerate.encode_prompt(tokenizer, [first])
        if len(templated) > max_prompt_tokens:
            continue
        forms["messages"].append(templated)
        forms["prompt"].append(list(tokenizer(first["content"])["input_ids"]))
        if len(forms["messages"]) == count:
            break
    return forms


@torch.no_grad()
def continuations(
    net: Any, prompts: Sequence[Sequence[int]], new_tokens: int, device: str
) -> Sequences:
    """The target's greedy continuations of ``new_tokens`` tokens, eos ignored (as the daemon
    serves ``ignore_eos``), in one left-padded batch. ``net``: the HF target."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), model.PAD_ID, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    # NOTE: an eos_token_id of None passed to generate falls back to the model's generation
    # config; only that config turns eos off.
    eos = net.generation_config.eos_token_id
    net.generation_config.eos_token_id = None
    try:
        out = net.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            max_new_tokens=new_tokens,
            min_new_tokens=0,
            do_sample=False,
            pad_token_id=model.PAD_ID,
        )
    finally:
        net.generation_config.eos_token_id = eos
    answers = out[:, width:].tolist()
    return from_pairs(prompts, answers)


def heldout_sets(
    out: Path,
    net: Any,
    tokenizer: PreTrainedTokenizerBase,
    count: int,
    new_tokens: int,
    lookahead: int,
    device: str,
) -> dict[str, Sequences]:
    """Per form, the held-out prompts with ``new_tokens + lookahead`` greedy tokens (the
    lookahead settles the last verify's drafts)."""
    forms = heldout_prompts(out, tokenizer, count, MAX_PROMPT_TOKENS)
    return {
        form: continuations(net, prompts, new_tokens + lookahead, device)
        for form, prompts in forms.items()
    }


class TargetTaps:
    """The frozen HF target run over right-padded rows (causal: padding after a row's end
    changes nothing before it), capturing the residual stream after each tapped layer."""

    def __init__(self, net: Any, layers: Sequence[int]) -> None:
        self.net = net
        self.layers = tuple(layers)
        self.lm_weight: torch.Tensor = net.get_output_embeddings().weight  # [V, H_t]
        self._captured: dict[int, torch.Tensor] = {}
        for layer in self.layers:
            net.model.layers[layer].register_forward_hook(self._hook(layer))

    def _hook(self, layer: int) -> Any:
        def hook(_module: Any, _inputs: Any, output: Any) -> None:
            self._captured[layer] = output if isinstance(output, torch.Tensor) else output[0]

        return hook

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``tokens: [B, T]`` -> (taps ``[B, T, L * H_t]`` in ``layers`` order, the final-norm
        hidden states ``[B, T, H_t]``; the target's logits are ``hidden @ lm_weight.T``)."""
        self._captured.clear()
        hidden = self.net.model(input_ids=tokens, use_cache=False).last_hidden_state
        taps = torch.cat([self._captured[layer] for layer in self.layers], dim=-1)
        self._captured.clear()
        return taps, hidden


def answer_token_counts(sequences: Sequences, vocab_size: int) -> torch.Tensor:
    """``[vocab_size]`` int64: how often each token occurs in the answers."""
    return torch.bincount(sequences.tokens[sequences.answer], minlength=vocab_size)


def check_taps(layers: Sequence[int], num_target_layers: int, what: str) -> None:
    """Distinct ids in ``0 .. N - 2``: the last layer's HF ``hidden_states`` entry is taken
    after the final norm, so readers of the public layouts disagree about it."""
    last = num_target_layers - 2
    if len(set(layers)) != len(layers) or not all(0 <= t <= last for t in layers):
        raise ValueError(f"{what} {list(layers)} must be distinct layers in 0..{last}")


# --- offline acceptance -------------------------------------------------------------------


@dataclass(frozen=True)
class Acceptance:
    verifies: int
    accepted: int
    per_position: list[int]

    @property
    def tau(self) -> float:
        """Mean acceptance length, the bonus token included."""
        return 1 + self.accepted / max(self.verifies, 1)

    def as_stats(self) -> dict[str, Any]:
        return {
            "tau": round(self.tau, 4),
            "verifies": self.verifies,
            "accepted": self.accepted,
            "accepted_per_position": self.per_position,
        }


def greedy_walk(drafts: torch.Tensor, sequences: Sequences, new_tokens: int) -> Acceptance:
    """Greedy speculative decoding over the target's own continuations, as the daemon
    counts it.

    ``drafts: [N, T, S]``: ``drafts[i, r]`` are the draft's guesses for the tokens at
    ``r + 1 .. r + S`` when the root (the last committed token, its KV not yet written) sits
    at position ``r`` and everything before it is the target's. Each request starts with the
    root at its prompt length (the first new token comes from prefill) and stops once it has
    ``new_tokens``; a verify commits the leading matches plus the bonus token (the last one
    may run past ``new_tokens``: tokens past a row's length never match)."""
    steps = drafts.shape[-1]
    verifies, per_position = 0, [0] * steps
    drafts, tokens = drafts.cpu(), sequences.tokens.cpu()
    for row in range(len(sequences)):
        start, end = int(sequences.prompt_lengths[row]), int(sequences.lengths[row])
        truth = torch.full((end + steps + 1,), -1, dtype=torch.int64)
        truth[:end] = tokens[row, :end]
        root = start
        while root - start + 1 < new_tokens:
            hits = (drafts[row, root] == truth[root + 1 : root + 1 + steps]).int().cumprod(0)
            accepted = int(hits.sum())
            verifies += 1
            for k in range(accepted):
                per_position[k] += 1
            root += accepted + 1
    return Acceptance(verifies, sum(per_position), per_position)
