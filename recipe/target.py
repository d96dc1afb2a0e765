"""Stage 3 (``target``): train the Qwen3-shaped target on packed chat text and export it.

Loss is next-token cross entropy on every token of a row (prompts, answers, template tokens
and separators alike); the held-out loss is the same mean over all held-out rows. AdamW with
linear warmup then cosine decay to ``min_lr_ratio * lr``; bf16 autocast on CUDA, float32 on
CPU. A call trains until it is done or its time budget is spent, then saves ``checkpoint.pt``
(weights, optimizer state, step); the next call with the same config resumes from there.
With ``steps == 0`` the first call measures its step time during warmup and fixes the total
number of steps so that training takes ``train_seconds``.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from recipe import data, model, packing
from recipe.manifest import Manifest, Produced, input_hashes, require, run_once, stage_key

if TYPE_CHECKING:
    from transformers import Qwen3ForCausalLM

CHECKPOINT = "checkpoint.pt"
EXPORT_DIR = "model"
LOG = "train_log.jsonl"
VERSION = 1  # bump when the outputs for a given config change
_CALIBRATION = (10, 40)  # steps timed to size the run when steps == 0
_LOG_EVERY = 100
_EXPORT_RESERVE_S = 20.0  # budget kept back for the final evaluation and the export


@dataclass(frozen=True)
class TargetConfig:
    shape: str = "small"
    seq_len: int = 512
    batch_size: int = 64  # rows per step
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 200
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    # About 7 epochs of the ShareGPT train split at 64 x 512 tokens a step. Held-out loss
    # turns up past about 8 epochs (a 10.8-epoch run ended 0.04 above its best).
    steps: int = 5500  # 0: sized on the first call so that training takes train_seconds
    train_seconds: float = 330.0
    eval_every: int = 1000
    export_dtype: str = "bfloat16"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.shape not in model.SHAPES:
            raise ValueError(f"unknown shape {self.shape!r} (known: {', '.join(model.SHAPES)})")
        if self.steps == 0 and self.warmup_steps < _CALIBRATION[1]:
            raise ValueError(f"sizing the run needs warmup_steps >= {_CALIBRATION[1]}")


@dataclass(frozen=True)
class TargetRuntime:
    """How this call runs; not part of the stage's identity."""

    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    budget_s: float = 450.0  # wall time of this call, encoding and export included
    max_steps_this_call: int | None = None


@dataclass
class TrainState:
    step: int = 0
    total_steps: int = 0  # 0 until sized
    train_seconds: float = 0.0
    history: list[dict[str, float]] = field(default_factory=list)


def lr_at(step: int, total: int, config: TargetConfig) -> float:
    """Linear warmup, then cosine decay; ``total`` may be 0 (not sized yet) during warmup."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    if total <= 0:
        raise ValueError("the run must be sized before its warmup ends")
    span = max(1, total - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    floor = config.lr * config.min_lr_ratio
    return floor + (config.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def batches_from(
    rows: torch.Tensor, batch_size: int, seed: int, start: int
) -> Iterator[torch.Tensor]:
    """Row batches for steps ``start, start + 1, ...``: each epoch is a fresh permutation
    seeded by (seed, epoch), so a resumed run sees exactly the batches it would have seen."""
    per_epoch = len(rows) // batch_size
    if per_epoch == 0:
        raise ValueError(f"{len(rows)} rows do not fill one batch of {batch_size}")
    step = start
    while True:
        epoch, index = divmod(step, per_epoch)
        generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        # NOTE: one host-to-device copy per epoch; a copy per step would sync every step.
        order = torch.randperm(len(rows), generator=generator).to(rows.device)
        for i in range(index, per_epoch):
            yield rows[order[i * batch_size : (i + 1) * batch_size]]
        step = (epoch + 1) * per_epoch


def _autocast(device: str) -> contextlib.AbstractContextManager[Any]:
    if device.startswith("cuda"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def evaluate(net: Qwen3ForCausalLM, rows: torch.Tensor, batch_size: int, device: str) -> float:
    """Mean next-token loss over every predicted token of ``rows``."""
    net.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    for batch in rows.split(batch_size):
        with _autocast(device):
            loss = net(input_ids=batch, labels=batch, use_cache=False).loss
        total += loss.double() * len(batch)
    net.train()
    return float(total) / len(rows)


def make_optimizer(net: torch.nn.Module, config: TargetConfig, device: str) -> torch.optim.AdamW:
    params = [p for p in net.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": config.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    fused = device.startswith("cuda")
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95), fused=fused)


def save_checkpoint(
    path: Path, key: str, state: TrainState, net: torch.nn.Module, opt: torch.optim.Optimizer
) -> None:
    payload = {
        "key": key,
        "state": asdict(state),
        "model": net.state_dict(),
        "optimizer": opt.state_dict(),
    }
    partial = path.with_suffix(".partial")
    torch.save(payload, partial)
    partial.replace(path)


def load_checkpoint(
    path: Path,
    key: str,
    net: torch.nn.Module,
    opt: torch.optim.Optimizer,
    stage: str = "target",
) -> TrainState:
    if not path.is_file():
        return TrainState()
    payload = torch.load(path, map_location="cpu", weights_only=True)
    if payload["key"] != key:
        raise ValueError(
            f"{path} belongs to another config or other inputs; remove it or use another --out"
        )
    net.load_state_dict(payload["model"])
    opt.load_state_dict(payload["optimizer"])
    state = TrainState(**payload["state"])
    print(f"[{stage}] resumed at step {state.step}/{state.total_steps or '?'}")
    return state


def _log(stage_dir: Path, record: dict[str, Any]) -> None:
    print(f"[target] {json.dumps(record)}", flush=True)
    with (stage_dir / LOG).open("a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def train_step(
    net: Qwen3ForCausalLM,
    opt: torch.optim.Optimizer,
    batch: torch.Tensor,
    lr: float,
    config: TargetConfig,
    device: str,
) -> torch.Tensor:
    # batch: [B, seq_len]
    for group in opt.param_groups:
        group["lr"] = lr
    with _autocast(device):
        loss = net(input_ids=batch, labels=batch, use_cache=False).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(net.parameters(), config.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


class _Sizer:
    """Times steps ``_CALIBRATION`` of this call and fixes the run's total steps from them."""

    def __init__(self, state: TrainState, config: TargetConfig, device: str) -> None:
        self.active = state.total_steps == 0
        self.first = state.step + _CALIBRATION[0]
        self.last = state.step + _CALIBRATION[1]
        self.started = 0.0
        self.config = config
        self.device = device
        if self.active and self.last > config.warmup_steps:
            raise ValueError("cannot size a run resumed this late in warmup; pass --steps")

    def after_step(self, state: TrainState) -> None:
        if not self.active or state.step not in (self.first, self.last):
            return
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
        if state.step == self.first:
            self.started = time.monotonic()
            return
        per_step = (time.monotonic() - self.started) / (self.last - self.first)
        state.total_steps = max(self.last + 1, int(self.config.train_seconds / per_step))
        self.active = False
        print(f"[target] {per_step * 1e3:.1f} ms/step: the run is {state.total_steps} steps")


@dataclass(frozen=True)
class _Run:
    """Everything one call trains with."""

    net: Qwen3ForCausalLM
    opt: torch.optim.Optimizer
    train_rows: torch.Tensor  # [n_train_rows, seq_len]
    heldout_rows: torch.Tensor  # [n_heldout_rows, seq_len]
    config: TargetConfig
    runtime: TargetRuntime
    stage_dir: Path


def train_call(run: _Run, state: TrainState, deadline: float) -> bool:
    """Train until the run is done (True) or this call's budget is spent (False)."""
    config, device = run.config, run.runtime.device
    if config.steps:
        state.total_steps = config.steps
    sizer = _Sizer(state, config, device)
    batches = batches_from(run.train_rows, config.batch_size, config.seed, state.step)
    running, count, call_steps = torch.zeros((), device=device), 0, 0
    started = time.monotonic()
    while state.total_steps == 0 or state.step < state.total_steps:
        limit = run.runtime.max_steps_this_call
        if time.monotonic() > deadline or (limit is not None and call_steps >= limit):
            break
        lr = lr_at(state.step, state.total_steps, config)
        running += train_step(run.net, run.opt, next(batches), lr, config, device)
        state.step, count, call_steps = state.step + 1, count + 1, call_steps + 1
        sizer.after_step(state)
        if state.step % _LOG_EVERY == 0 or state.step == state.total_steps:
            elapsed = state.train_seconds + time.monotonic() - started
            record = {"step": state.step, "loss": float(running) / count, "lr": lr}
            _log(run.stage_dir, record | {"seconds": round(elapsed, 1)})
            running, count = torch.zeros((), device=device), 0
        if state.step % config.eval_every == 0:
            _evaluate_into(run, state)
    state.train_seconds += time.monotonic() - started
    return state.total_steps > 0 and state.step >= state.total_steps


def _evaluate_into(run: _Run, state: TrainState) -> float:
    loss = evaluate(run.net, run.heldout_rows, run.config.batch_size, run.runtime.device)
    state.history.append({"step": state.step, "heldout_loss": loss})
    _log(run.stage_dir, {"step": state.step, "heldout_loss": round(loss, 4)})
    return loss


def _prepare(
    config: TargetConfig, runtime: TargetRuntime, out: Path, stage_dir: Path, cache_id: str
) -> _Run:
    tokenizer = packing.load_tokenizer(out / "tokenizer")
    rows = {}
    for split in (data.TRAIN, data.HELDOUT):
        name = split.removesuffix(".jsonl")
        cache = stage_dir / f"{name}.{cache_id}.npy"
        stream = packing.cached_stream(tokenizer, out / "data" / split, cache)
        rows[name] = packing.rows(stream, config.seq_len).to(runtime.device)
        print(f"[target] {name}: {len(stream)} tokens, {len(rows[name])} rows")
    shape = model.SHAPES[config.shape]
    hf_config = model.qwen3_config(shape, len(tokenizer), max_positions=config.seq_len)
    net = model.build(hf_config, config.seed, runtime.device)
    net.train()
    print(f"[target] {model.count_parameters(net):,} parameters (embedding tied, counted once)")
    opt = make_optimizer(net, config, runtime.device)
    return _Run(net, opt, rows["train"], rows["heldout"], config, runtime, stage_dir)


def _train_and_export(
    config: TargetConfig,
    runtime: TargetRuntime,
    out: Path,
    stage_dir: Path,
    key: str,
    started: float,
    cache_id: str,
) -> Produced | None:
    run = _prepare(config, runtime, out, stage_dir, cache_id)
    state = load_checkpoint(stage_dir / CHECKPOINT, key, run.net, run.opt)
    deadline = started + runtime.budget_s - _EXPORT_RESERVE_S
    done = train_call(run, state, deadline)
    save_checkpoint(stage_dir / CHECKPOINT, key, state, run.net, run.opt)
    if not done:
        total = state.total_steps or "?"
        print(f"[target] stopped at step {state.step}/{total}: run again to resume")
        return None
    evaluated = state.history and state.history[-1]["step"] == state.step
    heldout_loss = state.history[-1]["heldout_loss"] if evaluated else _evaluate_into(run, state)
    dtype = getattr(torch, config.export_dtype)
    model.export(run.net, out / "tokenizer", stage_dir / EXPORT_DIR, dtype)
    stats = _stats(run, state, heldout_loss)
    print(f"[target] {json.dumps({k: v for k, v in stats.items() if k != 'history'})}")
    return Produced([f"{EXPORT_DIR}/{name}" for name in model.EXPORT_FILES], stats)


def _stats(run: _Run, state: TrainState, heldout_loss: float) -> dict[str, Any]:
    import transformers

    device = run.runtime.device
    tokens = state.step * run.config.batch_size * run.config.seq_len
    per_epoch = len(run.train_rows) // run.config.batch_size
    return {
        "parameters": model.count_parameters(run.net),
        "steps": state.step,
        "epochs": round(state.step / per_epoch, 3),
        "tokens_seen": tokens,
        "train_seconds": round(state.train_seconds, 1),
        "tokens_per_second": round(tokens / max(state.train_seconds, 1e-9)),
        "heldout_loss": round(heldout_loss, 4),
        "train_rows": len(run.train_rows),
        "heldout_rows": len(run.heldout_rows),
        "device": torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "history": state.history,
    }


def stage_identity(config: TargetConfig) -> dict[str, Any]:
    """The config, the shape, and the sampling defaults the export writes: a change to any of
    them makes a complete stage run again."""
    return asdict(config) | {
        "model_shape": asdict(model.SHAPES[config.shape]),
        "generation": model.GENERATION_DEFAULTS,
        "version": VERSION,
    }


def stage_inputs(out: Path) -> dict[str, str]:
    return input_hashes(require(out / "data", "data"), require(out / "tokenizer", "tokenizer"))


def run(config: TargetConfig, runtime: TargetRuntime, out: Path) -> Manifest | None:
    """Stage 3: needs stages 1 and 2. Returns None when this call stopped before the end."""
    started = time.monotonic()
    inputs = stage_inputs(out)
    identity = stage_identity(config)
    key = stage_key(identity, inputs)
    cache_id = stage_key({"version": VERSION}, inputs)[:16]  # token files: inputs only

    def produce(stage_dir: Path) -> Produced | None:
        return _train_and_export(config, runtime, out, stage_dir, key, started, cache_id)

    return run_once("target", out / "target", identity, inputs, produce)
