"""A test-only DFlash draft: ``distill_dflash`` trains one for the tiny Qwen3 target of
``model_fixtures`` on the target's own greedy continuations, with the recipe's training twin
of the draft (``recipe.dflash_net``), and exports it through the daemon's writer.

Blocks as the worker drafts them: a block anchored at ``p`` is ``[x_p, MASK, ...]`` at
positions ``p ..``; it sees the target's features strictly before ``p`` and the whole block;
slot ``k`` predicts ``x_{p+k}``. Trained from a random start, the draft learns the shape of the
tiny target's greedy text (runs and short cycles): acceptance about 2.1 with blocks of 4.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from draft_fixtures import (
    TAPS,
    Continuations,
    random_prompts,
    target_continuations,
    training_threads,
)

from recipe.dflash_net import DFlashNet
from recipe.dflash_train import export
from recipe.draft_layers import DraftShape

BLOCK = 4
NUM_PROMPTS = 1024
MAX_LEAD = 16  # random tokens before each prompt, so longer contexts are seen too
NEW_TOKENS = 48
TRAIN_STEPS = 300  # tau 2.11 on the test prompts (600: 2.33; 150: 1.35)
BATCH = 32
ANCHORS = 16  # blocks per sequence per step
LR = 3e-3
GAMMA = 4.0  # slot k is weighted exp(-(k - 1) / GAMMA)
# Target layers the draft reads: the first two of ``TAPS`` (a DFlash draft may not tap the
# last layer, whose public counterpart is taken after the final norm).
DFLASH_TAPS = TAPS[:2]


def _shape(target: Any) -> DraftShape:
    c = target.config
    return DraftShape(c.hidden_size, 128, 4, 2, c.head_dim, 1e6, c.rms_norm_eps)


def draft_config(target: Any, shape: DraftShape) -> dict[str, Any]:
    c = target.config
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        **shape.config_json(),
        "num_hidden_layers": 2,
        "vocab_size": c.vocab_size,
        "max_position_embeddings": c.max_position_embeddings,
        "block_size": BLOCK,
        "num_target_layers": c.num_hidden_layers,
        "target_hidden_size": c.hidden_size,
        "torch_dtype": "float32",
        "dflash_config": {
            "mask_token_id": c.vocab_size - 1,
            "target_layer_ids": list(DFLASH_TAPS),
        },
    }


def block_hidden(
    net: DFlashNet, embedding: torch.Tensor, data: Continuations, anchors: torch.Tensor
) -> torch.Tensor:
    """The final-norm hidden states ``[B, A, BLOCK, H]`` of the blocks at ``anchors [B, A]``."""
    mask = embedding.shape[0] - 1
    block = torch.full((*anchors.shape, BLOCK), mask, dtype=torch.int64)
    block[..., 0] = data.tokens.gather(1, anchors)
    return net(embedding[block], anchors, data.taps)


def _loss(net: DFlashNet, embedding: torch.Tensor, data: Continuations) -> torch.Tensor:
    width = data.tokens.shape[1]
    # Anchors: generated positions whose whole block lies in the generated text.
    ok = data.generated.clone()
    ok[:, width - BLOCK + 1 :] = False
    anchors = torch.multinomial(ok.float() + 1e-9, ANCHORS)  # [B, A]
    hidden = block_hidden(net, embedding, data, anchors)[:, :, 1:]  # [B, A, BLOCK - 1, H]
    positions = (anchors[..., None] + torch.arange(1, BLOCK)).flatten(1)
    labels = data.tokens.gather(1, positions).view(*anchors.shape, BLOCK - 1)
    valid = data.generated.gather(1, positions).view_as(labels)
    ce = F.cross_entropy((hidden @ embedding.T).flatten(0, 2), labels.flatten(), reduction="none")
    weights = torch.exp(-torch.arange(BLOCK - 1) / GAMMA) * valid
    return (ce.view_as(labels) * weights).sum() / weights.sum()


@training_threads()
def distill_dflash(target_dir: Path, out_dir: Path, *, seed: int = 0) -> Path:
    """Train a DFlash draft (blocks of ``BLOCK``) for the tied-embedding HF target at
    ``target_dir`` and save it at ``out_dir`` in the public layout. Deterministic given
    ``seed`` (on ``TRAIN_THREADS`` torch threads)."""
    target, data = _target_and_data(target_dir, seed)
    embedding = target.get_input_embeddings().weight.detach()
    shape = _shape(target)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    net = DFlashNet(shape, 2, len(DFLASH_TAPS), target.config.hidden_size)
    with torch.no_grad():
        for param in net.parameters():
            if param.dim() > 1:
                param.normal_(0.0, param.shape[-1] ** -0.5, generator=gen)
    optimizer = torch.optim.AdamW(net.parameters(), lr=LR)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * step / TRAIN_STEPS))
    )
    for _ in range(TRAIN_STEPS):
        batch = data.rows(torch.randint(0, NUM_PROMPTS, (BATCH,), generator=gen))
        loss = _loss(net, embedding, batch)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        optimizer.step()
        schedule.step()
    export(net.eval(), draft_config(target, shape), out_dir)
    return out_dir


def _target_and_data(target_dir: Path, seed: int) -> tuple[Any, Continuations]:
    import transformers

    # sdpa: the same greedy continuations as eager attention (taps within float32 rounding),
    # in about half the time.
    target = transformers.AutoModelForCausalLM.from_pretrained(
        target_dir, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    vocab = target.config.vocab_size
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(3, vocab) for _ in range(rng.randint(0, MAX_LEAD))] + prompt
        for prompt in random_prompts(rng, NUM_PROMPTS, vocab)
    ]
    with torch.no_grad():
        return target, _continuations(target, prompts, NEW_TOKENS)


def _continuations(target: Any, prompts: Sequence[Sequence[int]], new_tokens: int) -> Continuations:
    """The target's continuations with the taps of ``DFLASH_TAPS`` only."""
    data = target_continuations(target, prompts, new_tokens)
    width = len(DFLASH_TAPS) * target.config.hidden_size
    return dataclasses.replace(data, taps=data.taps[..., :width])


def dense_block_counts(
    target_dir: Path, draft_dir: Path, prompts: Sequence[Sequence[int]], new_tokens: int
) -> tuple[int, list[int]]:
    """What the engine should count serving ``prompts`` greedily for ``new_tokens`` each with
    the DFlash draft at ``draft_dir``, from the training twin over the target's own
    continuations: ``(drafts, accepted per position)`` (the last step of a request may accept
    past ``new_tokens``)."""
    import transformers

    from outrider.plugins.models.weights import checkpoint_tensors
    from outrider.plugins.speculative.dflash_model import load_dflash

    target = transformers.AutoModelForCausalLM.from_pretrained(
        target_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    draft = load_dflash(draft_dir, dtype=torch.float32, device="cpu", max_positions=256)
    net = DFlashNet(_shape(target), 2, len(DFLASH_TAPS), target.config.hidden_size)
    net.load_state_dict(checkpoint_tensors(draft))
    embedding = target.get_input_embeddings().weight.detach()
    drafts, per_position = 0, [0] * (BLOCK - 1)
    with torch.no_grad():
        data = _continuations(target, prompts, new_tokens + BLOCK)
        for row, prompt in enumerate(prompts):
            # The root (the last committed token, KV not yet written) sits at ``seq``.
            seq, made = len(prompt), 1
            while made < new_tokens:
                hidden = block_hidden(net, embedding, data.rows(torch.tensor([row])),
                                      torch.tensor([[seq]]))  # fmt: skip
                guesses = (hidden[0, 0, 1:] @ embedding.T).argmax(-1)
                truth = data.tokens[row, seq + 1 : seq + BLOCK]
                accepted = int((guesses == truth).int().cumprod(0).sum())
                drafts += 1
                for k in range(accepted):
                    per_position[k] += 1
                seq += accepted + 1
                made += accepted + 1
    return drafts, per_position
