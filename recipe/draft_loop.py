"""The draft stages' resumable training loop: AdamW with linear warmup then cosine decay, a
wall-time budget per call, ``checkpoint.pt`` between calls (the target stage's format).

A stage hands over a loss function of (sequence indices, step); batches are fresh
permutations per epoch seeded by (seed, epoch), and any randomness of the loss is seeded by
(seed, step), so a resumed run reaches the weights an uninterrupted one would.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from recipe import draft_data, packing, regenerate, target
from recipe.draft_data import Sequences
from recipe.manifest import input_hashes, require

CHECKPOINT = target.CHECKPOINT
LOG = target.LOG
LOG_EVERY = 50

# (sequence indices [batch], step) -> {"loss": scalar with grad, other figures: detached}
LossFn = Callable[[torch.Tensor, int], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class DraftRuntime:
    """How this call runs; not part of the stage's identity."""

    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    budget_s: float = 450.0  # wall time of this call, measurement and export included
    max_steps_this_call: int | None = None


@dataclass(frozen=True)
class Optim:
    lr: float
    epochs: float
    batch_size: int  # sequences per step
    warmup_fraction: float
    grad_clip: float
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0

    def total_steps(self, items: int) -> int:
        per_epoch = items // self.batch_size
        if per_epoch == 0:
            raise ValueError(f"{items} sequences do not fill one batch of {self.batch_size}")
        return max(1, round(self.epochs * per_epoch))

    def lr_at(self, step: int, total: int) -> float:
        warmup = max(1, round(self.warmup_fraction * total))
        if step < warmup:
            return self.lr * (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        floor = self.lr * self.min_lr_ratio
        return floor + (self.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def autocast(device: str) -> contextlib.AbstractContextManager[Any]:
    if device.startswith("cuda"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def step_generator(device: str, seed: int, step: int) -> torch.Generator:
    return torch.Generator(device).manual_seed(seed * 1_000_003 + step)


def make_optimizer(net: nn.Module, optim: Optim, device: str) -> torch.optim.AdamW:
    params = [p for p in net.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": optim.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    fused = device.startswith("cuda")
    return torch.optim.AdamW(groups, lr=optim.lr, betas=(0.9, 0.95), fused=fused)


@dataclass(frozen=True)
class Job:
    """One stage's training: what the loop needs besides the state."""

    stage: str
    net: nn.Module
    opt: torch.optim.Optimizer
    optim: Optim
    loss_fn: LossFn
    items: int  # training sequences
    seed: int
    device: str
    stage_dir: Path


def log(job: Job, record: dict[str, Any]) -> None:
    print(f"[{job.stage}] {json.dumps(record)}", flush=True)
    with (job.stage_dir / LOG).open("a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def train_step(job: Job, index: torch.Tensor, step: int, lr: float) -> dict[str, torch.Tensor]:
    for group in job.opt.param_groups:
        group["lr"] = lr
    with autocast(job.device):
        figures = job.loss_fn(index.to(job.device), step)
    figures["loss"].backward()
    torch.nn.utils.clip_grad_norm_(job.net.parameters(), job.optim.grad_clip)
    job.opt.step()
    job.opt.zero_grad(set_to_none=True)
    return {name: value.detach().float() for name, value in figures.items()}


def train_call(job: Job, state: target.TrainState, deadline: float, limit: int | None) -> bool:
    """Train until the run is done (True) or this call's budget is spent (False)."""
    state.total_steps = job.optim.total_steps(job.items)
    indices = torch.arange(job.items)
    batches = target.batches_from(indices, job.optim.batch_size, job.seed, state.step)
    sums: dict[str, torch.Tensor] = {}
    count, call_steps, started = 0, 0, time.monotonic()
    while state.step < state.total_steps:
        if time.monotonic() > deadline or (limit is not None and call_steps >= limit):
            break
        lr = job.optim.lr_at(state.step, state.total_steps)
        figures = train_step(job, next(batches), state.step, lr)
        for name, value in figures.items():
            sums[name] = sums.get(name, torch.zeros_like(value)) + value
        state.step, count, call_steps = state.step + 1, count + 1, call_steps + 1
        if state.step % LOG_EVERY == 0 or state.step == state.total_steps:
            elapsed = state.train_seconds + time.monotonic() - started
            record = {name: round(float(v) / count, 4) for name, v in sums.items()}
            log(job, {"step": state.step, **record, "lr": lr, "seconds": round(elapsed, 1)})
            state.history.append({"step": state.step, **record})
            sums, count = {}, 0
    state.train_seconds += time.monotonic() - started
    return state.step >= state.total_steps


def train(job: Job, key: str, deadline: float, limit: int | None) -> target.TrainState | None:
    """Resume from ``checkpoint.pt`` (which must carry ``key``), train within the budget
    and save the checkpoint. None when the run is not finished yet."""
    path = job.stage_dir / CHECKPOINT
    state = target.load_checkpoint(path, key, job.net, job.opt, job.stage)
    done = train_call(job, state, deadline, limit)
    target.save_checkpoint(path, key, state, job.net, job.opt)
    if not done:
        print(f"[{job.stage}] stopped at step {state.step}/{state.total_steps}: run again")
        return None
    return state


def device_name(device: str) -> str:
    return torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"


def versions() -> dict[str, str]:
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}


def stats(
    net: nn.Module,
    sequences: Sequences,
    state: target.TrainState,
    heldout: dict[str, Sequences],
    device: str,
) -> dict[str, Any]:
    """Figures every draft stage records."""
    return {
        "parameters": sum(p.numel() for p in net.parameters()),
        "train_sequences": len(sequences),
        "train_answer_tokens": int(sequences.answer.sum()),
        "steps": state.step,
        "train_seconds": round(state.train_seconds, 1),
        "final": state.history[-1] if state.history else {},
        "heldout_prompts": {form: len(rows) for form, rows in heldout.items()},
        "device": device_name(device),
        **versions(),
    }


def draft_stage_inputs(out: Path) -> dict[str, str]:
    """What a draft stage reads: the outputs of ``data``, ``target`` and ``regenerate``."""
    return input_hashes(
        require(out / "data", "data"),
        require(out / "target", "target"),
        require(out / "regenerate", "regenerate"),
    )


MEASURE_RESERVE_S = 40.0  # budget kept back for the held-out measurement and the export


def load_target_and_answers(
    out: Path, taps: tuple[int, ...], what: str, device: str
) -> tuple[Any, Any, Sequences]:
    """(tokenizer, frozen target, the regenerated training sequences), the taps checked."""
    target_dir = out / "target" / target.EXPORT_DIR
    tokenizer = packing.load_tokenizer(target_dir)
    target_net = regenerate.load_target(target_dir, device).requires_grad_(False)
    draft_data.check_taps(taps, target_net.config.num_hidden_layers, what)
    return tokenizer, target_net, draft_data.regenerated(out, tokenizer)


def fit(
    job_parts: tuple[str, nn.Module, LossFn, int],
    optim: Optim,
    seed: int,
    runtime: DraftRuntime,
    stage_dir: Path,
    key: str,
    started: float,
) -> target.TrainState | None:
    """Train ``(stage, net, loss_fn, items)`` with AdamW within this call's budget, keeping
    ``MEASURE_RESERVE_S`` back; resumable like ``train``."""
    stage, net, loss_fn, items = job_parts
    opt = make_optimizer(net, optim, runtime.device)
    job = Job(stage, net, opt, optim, loss_fn, items, seed, runtime.device, stage_dir)
    deadline = started + runtime.budget_s - MEASURE_RESERVE_S
    return train(job, key, deadline, runtime.max_steps_this_call)
