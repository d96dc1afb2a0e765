"""Test-only EAGLE-3 drafts: a dense reference of the draft's math (plain tensors, no paged
KV) and ``distill_eagle3``, which trains a draft for the tiny Llama target of
``model_fixtures`` so that speculative tests see real acceptance.

Positions, as the worker (``eagle3_impl``) reads them: draft row ``t`` takes the token at
``t + 1`` and the target's feature at ``t`` and predicts the token at ``t + 2``. While
drafting, the row at ``t + k`` (step ``k``) takes the draft's own output of row ``t + k - 1``
as its feature and attends to the catch-up rows ``<= t`` (target features) plus the rows
``t + 1 .. t + k`` drafted before it. Training unrolls exactly that::

    step k, base row i:  token x[i+k+1], position i+k, target x[i+k+2]
                         feat = fc(taps[i]) at k = 0, else y[k-1][i]
                         keys = step-0 rows 0..i, and row i of steps 1..k
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from outrider.plugins.models.weights import checkpoint_table
from outrider.plugins.speculative.eagle3_model import Eagle3Config, Eagle3Draft, build_eagle3
from recipe.export import save_eagle3

# --- the dense reference ------------------------------------------------------------------


@dataclass(frozen=True)
class DenseShape:
    """What the dense reference needs besides the weights (plain RoPE, no scaling)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    eps: float
    norm_before_residual: bool = False

    @classmethod
    def of(cls, config: Eagle3Config) -> DenseShape:
        m = config.model
        assert m.rope.llama3 is None, "the dense reference has plain RoPE only"
        return cls(
            m.num_q_heads, m.num_kv_heads, m.head_dim, m.rope.theta, m.rms_norm_eps,
            config.norm_before_residual,
        )  # fmt: skip


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE. ``x: [..., T, heads, D]``, ``positions: [T]``."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    angles = positions.float()[:, None] * inv_freq  # [T, D/2]
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]  # [T, 1, D/2]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def draft_qkv(
    w: Mapping[str, torch.Tensor],
    embeds: torch.Tensor,
    feat: torch.Tensor,
    positions: torch.Tensor,
    shape: DenseShape,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``embeds, feat: [..., T, H]`` -> ``q, k, v: [..., Hq, T, D]`` (K/V repeated per query
    group, RoPE applied at ``positions: [T]``)."""
    a = "midlayer.self_attn"
    x = torch.cat(
        (
            rms(embeds, w["midlayer.input_layernorm.weight"], shape.eps),
            rms(feat, w["midlayer.hidden_norm.weight"], shape.eps),
        ),
        dim=-1,
    )  # [..., T, 2H], embedding first
    group = shape.num_heads // shape.num_kv_heads

    def heads(name: str, n: int) -> torch.Tensor:
        return (x @ w[f"{a}.{name}_proj.weight"].T).unflatten(-1, (n, shape.head_dim))

    q = rope(heads("q", shape.num_heads), positions, shape.rope_theta)
    k = rope(heads("k", shape.num_kv_heads), positions, shape.rope_theta)
    v = heads("v", shape.num_kv_heads)
    q, k, v = (t.transpose(-3, -2) for t in (q, k, v))  # [..., heads, T, D]
    return q, k.repeat_interleave(group, -3), v.repeat_interleave(group, -3)


def unrolled_attention(
    q: torch.Tensor, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]
) -> torch.Tensor:
    """Row ``i`` of ``q: [..., Hq, T, D]`` attends to rows ``0 .. i`` of ``keys[0]`` (causal)
    and to row ``i`` of each later entry (the rows drafted before it in the unroll)."""
    n, d = q.shape[-2], q.shape[-1]
    causal = (q @ keys[0].transpose(-1, -2)) / math.sqrt(d)  # [..., Hq, T, T]
    causal = causal.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    diagonal = [(q * k).sum(-1, keepdim=True) / math.sqrt(d) for k in keys[1:]]  # [.., T, 1]
    probs = torch.cat((causal, *diagonal), dim=-1).softmax(-1)
    out = probs[..., :n] @ values[0]
    for j, v in enumerate(values[1:]):
        out = out + probs[..., n + j, None] * v
    return out  # [..., Hq, T, D]


def draft_out(
    w: Mapping[str, torch.Tensor], feat: torch.Tensor, attn: torch.Tensor, shape: DenseShape
) -> torch.Tensor:
    """``attn: [..., Hq, T, D]`` -> ``y: [..., T, H]`` (o_proj, residual ``feat`` or, with
    ``norm_before_residual``, its hidden norm; MLP)."""
    a, p = "midlayer.self_attn", "midlayer.mlp"
    residual = feat
    if shape.norm_before_residual:
        residual = rms(feat, w["midlayer.hidden_norm.weight"], shape.eps)
    h = residual + attn.transpose(-3, -2).flatten(-2) @ w[f"{a}.o_proj.weight"].T
    m = rms(h, w["midlayer.post_attention_layernorm.weight"], shape.eps)
    gate, up = m @ w[f"{p}.gate_proj.weight"].T, m @ w[f"{p}.up_proj.weight"].T
    return h + (F.silu(gate) * up) @ w[f"{p}.down_proj.weight"].T


def dense_eagle3(
    w: Mapping[str, torch.Tensor], embeds: torch.Tensor, feat: torch.Tensor, shape: DenseShape
) -> torch.Tensor:
    """One sequence from position 0, plain causal attention: ``y [T, H]``."""
    q, k, v = draft_qkv(w, embeds, feat, torch.arange(embeds.shape[-2]), shape)
    return draft_out(w, feat, unrolled_attention(q, [k], [v]), shape)


def draft_logits(w: Mapping[str, torch.Tensor], y: torch.Tensor, shape: DenseShape) -> torch.Tensor:
    return rms(y, w["norm.weight"], shape.eps) @ w["lm_head.weight"].T


def live_weights(model: Eagle3Draft) -> dict[str, torch.Tensor]:
    """Public checkpoint name -> the model's parameter or buffer (or a fused parameter's rows),
    kept in the autograd graph (``checkpoint_tensors`` hands out detached ``.data``)."""
    table = checkpoint_table(model).items()
    return {name: d.tensor if d.rows is None else d.tensor[d.rows] for name, d in table}


def unrolled_logits(
    w: Mapping[str, torch.Tensor],
    embedding: torch.Tensor,
    tokens: torch.Tensor,
    taps: torch.Tensor,
    steps: int,
    shape: DenseShape,
) -> list[torch.Tensor]:
    """The training-time-test unroll (module docstring) over ``tokens: [B, T]`` with the
    target's ``taps: [B, T, 3*H_t]``: per step ``k``, logits ``[B, T - 1 - steps, V_draft]``
    for base rows ``i``, predicting ``tokens[:, i + k + 2]``."""
    n = tokens.shape[1] - 1 - steps
    feat = taps[:, :n] @ w["fc.weight"].T  # [B, n, H]
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    logits = []
    for k in range(steps):
        embeds = embedding[tokens[:, k + 1 : k + 1 + n]]  # [B, n, H]
        q, key, value = draft_qkv(w, embeds, feat, torch.arange(n) + k, shape)
        keys.append(key)
        values.append(value)
        feat = draft_out(w, feat, unrolled_attention(q, keys, values), shape)
        logits.append(draft_logits(w, feat, shape))
    return logits


# --- distillation -------------------------------------------------------------------------
#
# The tiny target is random: its next-token distribution is nearly flat (top-1 probability
# about 0.02), so its greedy choice is close to a random function of the context. A draft
# trained from a random start memorises its training continuations and on new prompts drafts
# worse than "repeat the last token" (tau about 1.35 against 1.55). What carries over is the
# shape of the target's greedy text: it falls into runs and short cycles, where copying what
# followed the last occurrence of a token is right. So the draft starts as an in-context copy
# head (``copy_init``; tau about 1.6) and the distillation tunes it on the target's own
# continuations (tau about 1.75).

TAPS = (0, 1, 2)  # every layer of the 3-layer tiny target, output-of-layer convention
NUM_PROMPTS = 2048  # with a few dozen the distillation memorises instead of generalising
MAX_LEAD = 16  # random tokens before each prompt, so longer contexts are seen too
NEW_TOKENS = 48
STEPS = 3  # unrolled drafting steps, as speculative_num_steps 3 drafts
TRAIN_STEPS = 150
BATCH = 32
LR = 3e-3
LM_SCALE = 3.0  # lm_head starts as this times the target's embedding
CHUNK = 512  # rows per target batch


TRAIN_THREADS = 2  # a distillation's torch threads (the suite's tests run on one)


@contextmanager
def training_threads() -> Iterator[None]:
    """``TRAIN_THREADS`` torch threads, the caller's count restored after: a distillation is
    deterministic for a given count, and trains in about 0.6 of one thread's time."""
    previous = torch.get_num_threads()
    torch.set_num_threads(TRAIN_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def draft_config(target: Mapping[str, Any]) -> dict[str, Any]:
    """The draft's config.json for a target config: the target's width, heads and vocab, as
    many K/V heads as query heads (so the values carry a whole embedding), explicit taps,
    plain RoPE with a long wavelength (matching by content across the context)."""
    heads = target["num_attention_heads"]
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": target["hidden_size"],
        "intermediate_size": 4 * target["hidden_size"],
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "rms_norm_eps": target["rms_norm_eps"],
        "vocab_size": target["vocab_size"],
        "draft_vocab_size": target["vocab_size"],
        "rope_theta": 1e6,
        "max_position_embeddings": target["max_position_embeddings"],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(TAPS)},
    }


def random_prompts(rng: random.Random, count: int, vocab: int) -> list[list[int]]:
    """Half random, half a short random phrase repeated (ids 3 and up: past bos/eos)."""
    prompts = []
    for i in range(count):
        if i % 2:
            phrase = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 6))]
            prompts.append(phrase * rng.randint(3, 6))
        else:
            prompts.append([rng.randrange(3, vocab) for _ in range(rng.randint(5, 40))])
    return prompts


@dataclass(frozen=True)
class Continuations:
    """Prompts with the target's greedy continuations, right-padded, and its taps."""

    tokens: torch.Tensor  # [B, T] int64
    taps: torch.Tensor  # [B, T, 3*H_t]: the residual stream after each tapped layer
    valid: torch.Tensor  # [B, T] bool: not padding
    generated: torch.Tensor  # [B, T] bool: the target generated this token

    def rows(self, index: torch.Tensor) -> Continuations:
        return Continuations(*(getattr(self, f.name)[index] for f in dataclasses.fields(self)))


def target_continuations(
    target: Any, prompts: Sequence[Sequence[int]], new_tokens: int = NEW_TOKENS
) -> Continuations:
    """``target``: the HF model (eval mode). Greedy, eos disabled, ``new_tokens`` each."""
    width = max(len(p) for p in prompts)
    left = torch.zeros(len(prompts), width, dtype=torch.int64)  # left-padded for generate
    mask = torch.zeros_like(left)
    for row, prompt in enumerate(prompts):
        left[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    sequences: list[torch.Tensor] = []
    # NOTE: an eos_token_id of None passed to generate falls back to the model's; only the
    # model's own generation config turns eos off.
    eos = target.generation_config.eos_token_id
    target.generation_config.eos_token_id = None
    try:
        for start in range(0, len(prompts), CHUNK):
            out = target.generate(
                left[start : start + CHUNK],
                attention_mask=mask[start : start + CHUNK],
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            for row, sequence in enumerate(out, start):
                sequences.append(sequence[width - len(prompts[row]) :])
    finally:
        target.generation_config.eos_token_id = eos
    tokens = torch.zeros(len(prompts), max(len(s) for s in sequences), dtype=torch.int64)
    valid = torch.zeros_like(tokens, dtype=torch.bool)
    generated = torch.zeros_like(valid)
    for row, (prompt, sequence) in enumerate(zip(prompts, sequences, strict=True)):
        tokens[row, : len(sequence)] = sequence
        valid[row, : len(sequence)] = True
        generated[row, len(prompt) : len(sequence)] = True
    # NOTE: HF's last ``hidden_states`` entry is taken after the final norm, but the engine
    # captures the residual stream after every tapped layer, the last one included: hooks on
    # the decoder layers see exactly that.
    captured: dict[int, list[torch.Tensor]] = {layer: [] for layer in TAPS}

    def capture(layer: int) -> Any:
        def hook(_module: Any, _inputs: Any, out: Any) -> None:
            captured[layer].append(out if isinstance(out, torch.Tensor) else out[0])

        return hook

    hooks = [target.model.layers[layer].register_forward_hook(capture(layer)) for layer in TAPS]
    try:
        for start in range(0, len(prompts), CHUNK):
            target.model(tokens[start : start + CHUNK])  # right padding: no mask needed
    finally:
        for hook in hooks:
            hook.remove()
    taps = torch.cat([torch.cat(captured[layer]) for layer in TAPS], dim=-1)
    return Continuations(tokens, taps, valid, generated)


def _random_init(model: Eagle3Draft, gen: torch.Generator) -> None:
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.normal_(0.0, param.shape[-1] ** -0.5, generator=gen)
    model.d2t.zero_()
    model.t2d.fill_(True)


def copy_init(model: Eagle3Draft, embedding: torch.Tensor, data: Continuations) -> None:
    """Make ``model`` an in-context copy head: row ``t`` (token ``x[t+1]``) attends to the
    rows ``r`` whose own position held the same token (``x[r] == x[t+1]``) and reads their
    token ``x[r+1]``, the one that followed it last time.

    - ``fc``: a least-squares probe from the taps at ``r`` to the embedding of ``x[r]``, so
      the feature half of every row names its position's token;
    - ``q`` reads the token half, ``k`` the feature half (identity maps: they match when the
      tokens agree), ``v`` the token half; ``o_proj`` is the identity;
    - ``lm_head`` is ``LM_SCALE`` times the target's embedding, the MLP starts small.
    """
    h = embedding.shape[1]
    taps, tokens = data.taps[data.valid], data.tokens[data.valid]
    # NOTE: not the default driver (gelsy), whose result varies from run to run.
    probe = torch.linalg.lstsq(taps, embedding[tokens], driver="gelsd").solution  # [3*H_t, H]
    model.fc.weight.copy_(probe.T)
    qkv = model.midlayer.self_attn.qkv_proj
    qkv.weight.mul_(0.1)
    eye = torch.eye(h)
    qkv.weight[qkv.shards["q"], :h] += eye
    qkv.weight[qkv.shards["k"], h:] += eye
    qkv.weight[qkv.shards["v"], :h] += eye
    model.midlayer.self_attn.o_proj.weight.copy_(eye)
    model.midlayer.mlp.down_proj.weight.mul_(0.1)
    model.lm_head.weight.copy_(LM_SCALE * embedding)


def unrolled_loss(
    w: Mapping[str, torch.Tensor], embedding: torch.Tensor, data: Continuations, shape: DenseShape
) -> torch.Tensor:
    """Cross entropy against the target's greedy tokens, step ``k`` weighted ``0.8 ** k``,
    over the rows whose label the target generated."""
    logits = unrolled_logits(w, embedding, data.tokens, data.taps, STEPS, shape)
    n = logits[0].shape[1]
    total = torch.zeros(())
    for k, step_logits in enumerate(logits):
        labels = data.tokens[:, k + 2 : k + 2 + n]
        mask = data.generated[:, k + 2 : k + 2 + n]
        total = total + 0.8**k * F.cross_entropy(step_logits[mask], labels[mask])
    return total


@training_threads()
def distill_eagle3(target_dir: Path, out_dir: Path, *, seed: int = 0) -> Path:
    """Train an EAGLE-3 draft for the HF target at ``target_dir`` on its own greedy
    continuations and save it at ``out_dir`` (public layout, explicit taps, the target's
    vocabulary). Deterministic given ``seed`` (on ``TRAIN_THREADS`` torch threads)."""
    import transformers

    # sdpa: the same greedy continuations as eager attention (taps within float32 rounding),
    # in about half the time.
    target = transformers.AutoModelForCausalLM.from_pretrained(
        target_dir, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    target_config = target.config.to_dict()
    config_json = draft_config(target_config)
    config = Eagle3Config.from_dict(config_json)
    shape = DenseShape.of(config)
    vocab = target_config["vocab_size"]
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(3, vocab) for _ in range(rng.randint(0, MAX_LEAD))] + prompt
        for prompt in random_prompts(rng, NUM_PROMPTS, vocab)
    ]
    embedding = target.get_input_embeddings().weight.detach()
    gen = torch.Generator().manual_seed(seed)
    model = build_eagle3(
        config, max_positions=config.model.max_position_embeddings, dtype=torch.float32,
        device="cpu",
    )  # fmt: skip
    with torch.no_grad():
        data = target_continuations(target, prompts)
        _random_init(model, gen)
        copy_init(model, embedding, data)

    params = [p for p in model.parameters() if p.is_floating_point()]
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=LR)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * step / TRAIN_STEPS))
    )
    for _ in range(TRAIN_STEPS):
        batch = data.rows(torch.randperm(NUM_PROMPTS, generator=gen)[:BATCH])
        loss = unrolled_loss(live_weights(model), embedding, batch, shape)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
    model.requires_grad_(False)
    save_eagle3(model, out_dir, config_json)
    return out_dir
