"""Stage 5a (``eagle3``): an EAGLE-3 draft trained on the target's own answers, exported as
``LlamaForCausalLMEagle3`` in the public layout.

- Draft vocabulary: the ``draft_vocab_size`` most frequent tokens of the regenerated answers
  (ties by id), in ascending id order; ``d2t[i] = target_id - i``, ``t2d`` marks them.
- Features: the frozen target over prompt + answer, taps ``aux_layer_ids`` in the
  output-of-layer convention (id L = the residual stream after decoder layer L, 0-based = HF
  ``hidden_states[L + 1]``), written to ``eagle_config.eagle_aux_hidden_state_layer_ids``.
- Training-time test (``eagle3_net``): ``steps`` unrolled steps, step k weighted
  ``step_decay ** k``; soft-label cross entropy against the target's distribution restricted
  to the draft vocabulary (renormalised), on rows whose label is an answer token and whose
  target argmax is in the draft vocabulary. AdamW, warmup then cosine, grad clip.
- Initialisation: linear layers N(0, 0.02); ``lm_head`` and ``norm`` start as the target's
  LM head rows of the draft vocabulary and the target's final norm.
- Measured: greedy chains of ``eval_chains`` drafts over the target's greedy continuations
  (eos ignored) of the held-out prompts, sent through the chat template and as raw text
  (``draft_data.heldout_sets``, ``draft_data.greedy_walk``), recorded in the manifest.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from recipe import draft_data, draft_loop, model
from recipe.draft_data import Sequences, TargetTaps
from recipe.draft_layers import DraftShape, init_weights
from recipe.eagle3_net import Eagle3Net
from recipe.manifest import Manifest, Produced, run_once, stage_key

STAGE = "eagle3"
EXPORT_DIR = "model"
EXPORT_FILES = ("config.json", "model.safetensors", "README.md")
VERSION = 2  # bump when the outputs for a given config change (2: held-out forms)
CONVENTION = (
    "output-of-layer: id L is the residual stream after decoder layer L (0-based), which is "
    "Hugging Face hidden_states[L + 1], before the final norm"
)
_EVAL_ROWS = 25  # held-out rows per unroll


@dataclass(frozen=True)
class Eagle3StageConfig:
    aux_layer_ids: tuple[int, ...] = (1, 4, 7)  # low, mid, high
    draft_vocab_size: int = 2048
    intermediate_size: int = 768
    num_heads: int = 4
    num_kv_heads: int = 2
    steps: int = 7  # training-time test unroll
    step_decay: float = 0.8
    # The reference's 1e-4 is for large drafts and long runs; 5e-4 for 6 epochs of 13,690
    # answers (2,562 steps, 298 s on an H100 beside another training) reaches held-out chain
    # tau 2.42 (README).
    lr: float = 5e-4
    epochs: float = 6.0
    batch_size: int = 32
    warmup_fraction: float = 0.04
    grad_clip: float = 0.5
    eval_prompts: int = 100
    eval_new_tokens: int = 128
    eval_chains: tuple[int, ...] = (3, 5)
    export_dtype: str = "bfloat16"
    seed: int = 0

    def __post_init__(self) -> None:
        if len(self.aux_layer_ids) != 3:
            raise ValueError(f"EAGLE-3 taps three layers, not {list(self.aux_layer_ids)}")
        if max(self.eval_chains) > self.steps:
            raise ValueError(f"eval_chains {self.eval_chains} exceed the unroll of {self.steps}")

    @property
    def optim(self) -> draft_loop.Optim:
        return draft_loop.Optim(
            self.lr, self.epochs, self.batch_size, self.warmup_fraction, self.grad_clip
        )


@dataclass(frozen=True)
class DraftVocab:
    ids: torch.Tensor  # [draft_vocab] int64 target ids, ascending
    in_vocab: torch.Tensor  # [vocab] bool (t2d)

    @property
    def d2t(self) -> torch.Tensor:
        return self.ids - torch.arange(len(self.ids), device=self.ids.device)


def select_vocab(counts: torch.Tensor, size: int) -> DraftVocab:
    """The ``size`` most frequent tokens (ties by id; all of them when the target's
    vocabulary is no larger)."""
    size = min(size, len(counts))
    order = sorted(range(len(counts)), key=lambda i: (-int(counts[i]), i))[:size]
    ids = torch.tensor(sorted(order), dtype=torch.int64)
    in_vocab = torch.zeros(len(counts), dtype=torch.bool)
    in_vocab[ids] = True
    return DraftVocab(ids, in_vocab)


@dataclass(frozen=True)
class Frozen:
    """What the loss reads besides the draft: the target and the vocabulary map."""

    taps: TargetTaps
    embedding: torch.Tensor  # [V, H] the target's
    vocab: DraftVocab  # on the device


def unroll_inputs(
    frozen: Frozen, batch: Sequences, steps: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(embeds ``[B, n + steps, H]`` of the tokens at ``1 ..``, taps ``[B, n, 3 H_t]``, the
    target's final hidden ``[B, n + steps + 1, H_t]``, answer ``[B, n + steps + 1]``) for
    ``n`` base rows; rows are padded so that every step has a label slot."""
    n = batch.tokens.shape[1]
    tokens = F.pad(batch.tokens, (0, steps + 1), value=model.PAD_ID)
    answer = F.pad(batch.answer, (0, steps + 1), value=False)
    taps, hidden = frozen.taps(tokens)
    return frozen.embedding[tokens[:, 1 : n + steps]], taps[:, :n], hidden, answer


def ttt_loss(
    net: Eagle3Net, frozen: Frozen, batch: Sequences, config: Eagle3StageConfig
) -> dict[str, torch.Tensor]:
    """The weighted soft-label loss of the unroll, and each step's top-1 agreement."""
    embeds, taps, hidden, answer = unroll_inputs(frozen, batch, config.steps)
    n = taps.shape[1]
    lm_weight = frozen.taps.lm_weight
    with torch.no_grad():
        greedy = (hidden @ lm_weight.T).argmax(-1)  # [B, n + steps + 1]: the target's next
        in_vocab = frozen.vocab.in_vocab[greedy]
    outputs = net.unroll(embeds, taps, config.steps)
    total = torch.zeros((), device=taps.device)
    figures: dict[str, torch.Tensor] = {}
    for k, y in enumerate(outputs):
        # Row i of step k predicts the token at i + k + 2 from the target's state at i + k + 1.
        mask = answer[:, k + 2 : k + 2 + n] & in_vocab[:, k + 1 : k + 1 + n]  # [B, n]
        with torch.no_grad():
            state = hidden[:, k + 1 : k + 1 + n][mask]  # [M, H_t]
            p = (state @ lm_weight[frozen.vocab.ids].T).float().softmax(-1)  # [M, Vd]
        if p.shape[0] == 0:
            continue
        logits = net.logits(y[mask]).float()  # [M, Vd]
        total = total + config.step_decay**k * -(p * logits.log_softmax(-1)).sum(-1).mean()
        agree = (logits.argmax(-1) == p.argmax(-1)).float().mean()
        figures[f"acc{k}"] = agree.detach()
    return {"loss": total, **figures}


def init_net(net: Eagle3Net, target_net: Any, vocab: DraftVocab, seed: int) -> None:
    init_weights(net, 0.02, torch.Generator().manual_seed(seed))
    with torch.no_grad():
        lm_weight = target_net.get_output_embeddings().weight
        net.lm_head.weight.copy_(lm_weight[vocab.ids.to(lm_weight.device)].float())
        net.norm.weight.copy_(target_net.model.norm.weight.float())


@torch.no_grad()
def chain_drafts(
    net: Eagle3Net, frozen: Frozen, sequences: Sequences, steps: int, device: str
) -> torch.Tensor:
    """``[N, T, steps]`` target ids: the greedy chain drafted with the root at each position
    (row ``r - 1`` of the unroll, teacher-forced on the target's tokens: exact while the
    chain is right, and a chain is only counted up to its first miss)."""
    n_rows, width = sequences.tokens.shape
    drafts = torch.full((n_rows, width, steps), -1, dtype=torch.int64)
    for start in range(0, n_rows, _EVAL_ROWS):
        index = torch.arange(start, min(start + _EVAL_ROWS, n_rows))
        batch = sequences.rows(index).to(device)
        with draft_loop.autocast(device):
            embeds, taps, _, _ = unroll_inputs(frozen, batch, steps)
            outputs = net.unroll(embeds, taps, steps)
            guesses = torch.stack([net.logits(y).argmax(-1) for y in outputs], dim=-1)
        guesses = frozen.vocab.ids[guesses].cpu()  # [b, n, steps]
        n = guesses.shape[1]  # base row i is the root at i + 1
        drafts[index, 1:n] = guesses[:, : n - 1]
    return drafts


def measure(
    net: Eagle3Net,
    frozen: Frozen,
    heldout: dict[str, Sequences],
    config: Eagle3StageConfig,
    device: str,
) -> dict[str, Any]:
    """Per form, greedy chains of each ``eval_chains`` length."""
    net.eval()
    out: dict[str, Any] = {}
    for form, sequences in heldout.items():
        drafts = chain_drafts(net, frozen, sequences, max(config.eval_chains), device)
        out[form] = {
            f"chain{chain}": draft_data.greedy_walk(
                drafts[..., :chain], sequences, config.eval_new_tokens
            ).as_stats()
            for chain in config.eval_chains
        }
    return out


def export_config(
    config: Eagle3StageConfig, shape: DraftShape, target_config: Any, vocab: DraftVocab
) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        **shape.config_json(),
        "num_hidden_layers": 1,
        "vocab_size": target_config.vocab_size,
        "draft_vocab_size": len(vocab.ids),
        "target_hidden_size": target_config.hidden_size,
        "max_position_embeddings": target_config.max_position_embeddings,
        "bos_token_id": None,
        "eos_token_id": model.EOS_ID,
        "pad_token_id": model.PAD_ID,
        "torch_dtype": config.export_dtype,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(config.aux_layer_ids),
            "layer_id_convention": CONVENTION,
        },
    }


def export(net: Eagle3Net, vocab: DraftVocab, config_json: dict[str, Any], directory: Path) -> None:
    """Through the daemon's own filler and ``recipe.export``'s writer: a layout the daemon's
    loader accepts as is."""
    from outrider.plugins.speculative.eagle3_model import Eagle3Config, build_eagle3, fill_eagle3
    from recipe.export import save_eagle3

    dtype = getattr(torch, config_json["torch_dtype"])
    parsed = Eagle3Config.from_dict(config_json)
    max_positions = parsed.model.max_position_embeddings
    draft = build_eagle3(parsed, max_positions=max_positions, dtype=dtype, device="cpu")
    tensors = [(name, t.detach().to("cpu", dtype)) for name, t in net.state_dict().items()]
    tensors += [("d2t", vocab.d2t.cpu()), ("t2d", vocab.in_vocab.cpu())]
    fill_eagle3(draft, tensors)
    if directory.exists():
        for stale in directory.iterdir():
            stale.unlink()
    save_eagle3(draft, directory, config_json)
    (directory / "README.md").write_text(_card(config_json), encoding="utf-8")


def _card(config_json: dict[str, Any]) -> str:
    eagle = config_json["eagle_config"]
    return (
        "# EAGLE-3 draft for the recipe's Qwen3 target\n\n"
        "Trained by `python recipe/train.py eagle3` on the target's own greedy answers "
        "(training-time test, soft labels over the draft vocabulary).\n\n"
        f"- taps: `eagle_config.eagle_aux_hidden_state_layer_ids` = "
        f"{eagle['eagle_aux_hidden_state_layer_ids']}, {CONVENTION}.\n"
        f"- draft vocabulary: {config_json['draft_vocab_size']} of "
        f"{config_json['vocab_size']} target tokens (`d2t`: target id - draft id; `t2d`).\n"
        "- no embedding: the target's is shared.\n"
    )


def _prepare(
    config: Eagle3StageConfig, out: Path, device: str
) -> tuple[Any, Any, Sequences, Frozen, Eagle3Net]:
    """(tokenizer, target, training sequences, frozen parts, initialised draft)."""
    tokenizer, target_net, sequences = draft_loop.load_target_and_answers(
        out, config.aux_layer_ids, "aux_layer_ids", device
    )
    target_config = target_net.config
    counts = draft_data.answer_token_counts(sequences, target_config.vocab_size)
    vocab = select_vocab(counts, config.draft_vocab_size)
    frozen = Frozen(
        TargetTaps(target_net, config.aux_layer_ids),
        target_net.get_input_embeddings().weight,
        DraftVocab(vocab.ids.to(device), vocab.in_vocab.to(device)),
    )
    shape = DraftShape.for_target(
        target_config, config.intermediate_size, config.num_heads, config.num_kv_heads
    )
    net = Eagle3Net(shape, target_config.hidden_size, len(vocab.ids))
    init_net(net, target_net, vocab, config.seed)
    return tokenizer, target_net, sequences, frozen, net.to(device).train()


def _train_and_export(
    config: Eagle3StageConfig,
    runtime: draft_loop.DraftRuntime,
    out: Path,
    stage_dir: Path,
    key: str,
    started: float,
) -> Produced | None:
    device = runtime.device
    tokenizer, target_net, sequences, frozen, net = _prepare(config, out, device)
    on_device = sequences.to(device)

    def loss_fn(index: torch.Tensor, step: int) -> dict[str, torch.Tensor]:
        return ttt_loss(net, frozen, on_device.rows(index), config)

    state = draft_loop.fit(
        (STAGE, net, loss_fn, len(sequences)), config.optim, config.seed, runtime, stage_dir,
        key, started,
    )  # fmt: skip
    if state is None:
        return None
    heldout = draft_data.heldout_sets(
        out,
        target_net,
        tokenizer,
        config.eval_prompts,
        config.eval_new_tokens,
        max(config.eval_chains),
        device,
    )
    acceptance = measure(net, frozen, heldout, config, device)
    shape = DraftShape.for_target(
        target_net.config, config.intermediate_size, config.num_heads, config.num_kv_heads
    )
    vocab = DraftVocab(frozen.vocab.ids.cpu(), frozen.vocab.in_vocab.cpu())
    export(
        net, vocab, export_config(config, shape, target_net.config, vocab), stage_dir / EXPORT_DIR
    )
    counts = draft_data.answer_token_counts(sequences, target_net.config.vocab_size)
    coverage = float(counts[vocab.ids].sum() / counts.sum())
    stats = draft_loop.stats(net, sequences, state, heldout, device) | {
        "draft_vocab_coverage": round(coverage, 4),
        "heldout_acceptance": acceptance,
    }
    print(f"[{STAGE}] {json.dumps(stats)}")
    return Produced([f"{EXPORT_DIR}/{name}" for name in EXPORT_FILES], stats)


def run(config: Eagle3StageConfig, runtime: draft_loop.DraftRuntime, out: Path) -> Manifest | None:
    """Stage 5a: needs stages 1, 3 and 4. None when this call stopped before the end."""
    started = time.monotonic()
    inputs = draft_loop.draft_stage_inputs(out)
    identity = asdict(config) | {"version": VERSION}
    key = stage_key(identity, inputs)

    def produce(stage_dir: Path) -> Produced | None:
        return _train_and_export(config, runtime, out, stage_dir, key, started)

    return run_once(STAGE, out / STAGE, identity, inputs, produce)
