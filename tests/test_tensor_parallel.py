"""Tensor-parallel models over torch.distributed (gloo, CPU, float32): two ranks against one.

Each rank loads its shard of the tiny checkpoints (and of dummy weights), runs a batch of
prompts and a few greedy decode steps over its own KV cache (its KV heads only), and writes
what it saw; the test compares that with the same run in a world of one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from daemon_harness import free_port
from model_fixtures import TINY, VOCAB, PagedRows, save_tiny_model, torch_backend

from outrider.daemon.models.config import ModelConfig, tensor_parallel_problems
from outrider.daemon.models.loader import build_model, check_checkpoint_layout, load_model
from outrider.daemon.models.parallel import (
    SINGLE,
    TPGroup,
    gather_vocab,
    init_tensor_parallel,
    vocab_argmax,
)

WORLD = 2
ATOL = 1e-5
PROMPTS = ((0, 11), (3, 6), (5, 17))  # (slot, prompt length)
DECODE_STEPS = 3
REFERENCE = Path(__file__).parent / "fixtures" / "configs"
# (checkpoint, load format): llama with biases on q/k/v and o_proj (the row-parallel bias),
# qwen2 (q/k/v bias only), qwen3 (q/k norm, head_dim 24, tied embeddings), and qwen3's
# dummy weights.
CASES: tuple[tuple[str, Literal["auto", "dummy"]], ...] = (
    ("llama", "auto"),
    ("qwen2", "auto"),
    ("qwen3", "auto"),
    ("qwen3", "dummy"),
)


@dataclass
class Trace:
    """One run: per step, the full logits ``[T, V]`` and the greedy ids ``[T]`` of every
    token, and the KV heads the rank's cache holds."""

    logits: list[torch.Tensor]
    greedy: list[torch.Tensor]
    kv_heads: int


def _save_checkpoints(root: Path) -> None:
    save_tiny_model(
        "llama", root / "llama", max_shard_size="60KB", config_overrides={"attention_bias": True}
    )
    save_tiny_model("qwen2", root / "qwen2")
    save_tiny_model("qwen3", root / "qwen3")


def _quiet(index: int, count: int, name: str) -> None:
    pass


def _run(directory: Path, load_format: Literal["auto", "dummy"], tp: TPGroup) -> Trace:
    model, _ = load_model(
        directory,
        dtype=torch.float32,
        device="cpu",
        load_format=load_format,
        max_positions=64,
        progress=_quiet,
        tp=tp,
    )
    shape = model.attention_shape
    rows = PagedRows(num_layers=model.num_layers, shape=shape, page_size=4, max_len=32)
    backend = torch_backend(shape)
    gen = torch.Generator().manual_seed(7)
    batch = [(slot, torch.randint(3, VOCAB, (n,), generator=gen).tolist()) for slot, n in PROMPTS]
    trace = Trace([], [], shape.num_kv_heads)
    for _ in range(1 + DECODE_STEPS):
        input_ids, fb = rows.batch(backend, batch, kv_slack=3)
        with torch.no_grad():
            hidden = model(input_ids, fb)
            trace.logits.append(model.compute_logits(hidden))
            trace.greedy.append(model.greedy_tokens(hidden))
        last = torch.tensor([len(tokens) for _, tokens in batch]).cumsum(0) - 1
        chosen = trace.greedy[-1][last].tolist()
        batch = [(slot, [token]) for (slot, _), token in zip(batch, chosen, strict=True)]
    return trace


def _argmax_ties(tp: TPGroup) -> torch.Tensor:
    """``vocab_argmax`` over slices built so that row 0 ties everywhere (id 0 wins), row 1's
    maximum is in the last rank's slice, row 2 ties across ranks (the lowest rank's id)."""
    width = VOCAB // tp.size
    local = torch.zeros(3, width)
    if tp.rank == tp.size - 1:
        local[1, 5] = 1.0
    local[2, 2] = 1.0
    return torch.stack((vocab_argmax(local, tp), gather_vocab(local, tp).argmax(-1)))


def _rank_main(rank: int, port: int, root: Path) -> None:
    torch.set_num_threads(1)
    tp = init_tensor_parallel(rank, WORLD, f"tcp://127.0.0.1:{port}", "gloo")
    try:
        traces = {case: _run(root / case[0], case[1], tp) for case in CASES}
        torch.save({"traces": traces, "ties": _argmax_ties(tp)}, root / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_ranks_match_one(tmp_path: Path) -> None:
    _save_checkpoints(tmp_path)
    mp.spawn(_rank_main, args=(free_port(), tmp_path), nprocs=WORLD, join=True)
    torch.set_num_threads(1)
    for rank in range(WORLD):
        seen = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        ties = seen["ties"]
        assert ties[0].tolist() == [0, VOCAB // WORLD + 5, 2] == ties[1].tolist()
        for case in CASES:
            ref = _run(tmp_path / case[0], case[1], SINGLE)
            got: Trace = seen["traces"][case]
            assert got.kv_heads == TINY["num_key_value_heads"] // WORLD, case
            assert len(got.logits) == 1 + DECODE_STEPS
            for step, (logits, greedy, ref_logits, ref_greedy) in enumerate(
                zip(got.logits, got.greedy, ref.logits, ref.greedy, strict=True)
            ):
                torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)
                assert torch.equal(greedy, ref_greedy), (case, rank, step)
                assert torch.equal(greedy, ref_logits.argmax(-1)), (case, rank, step)


def _llama_dict(**changes: int) -> dict[str, object]:
    return TINY | {"architectures": ["LlamaForCausalLM"], "model_type": "llama"} | changes


def test_refuses_what_does_not_divide() -> None:
    assert tensor_parallel_problems(_llama_dict(), 2) == []
    assert tensor_parallel_problems(_llama_dict(vocab_size=301), 1) == []
    assert tensor_parallel_problems(_llama_dict(vocab_size=301, num_key_value_heads=1), 2) == [
        "--tensor-parallel-size 2 does not divide the model's num_key_value_heads (1): "
        "each rank takes an equal share",
        "--tensor-parallel-size 2 does not divide the model's vocab_size (301): "
        "each rank takes an equal share",
    ]
    # num_key_value_heads absent: as many as the attention heads.
    no_kv = _llama_dict(num_attention_heads=6)
    del no_kv["num_key_value_heads"]
    assert [p.split("'s ")[1] for p in tensor_parallel_problems(no_kv, 4)] == [
        "num_attention_heads (6): each rank takes an equal share",
        "num_key_value_heads (6): each rank takes an equal share",
    ]
    config = ModelConfig.from_dict(_llama_dict(num_attention_heads=8, num_key_value_heads=8))
    with pytest.raises(ValueError, match=r"^--tensor-parallel-size 3 does not divide .*heads"):
        build_model(config, max_positions=1, dtype=torch.float32, device="meta", tp=TPGroup(0, 3))


@pytest.mark.parametrize("name", ["Qwen3-8B", "Llama-3.1-8B-Instruct"])
def test_reference_configs_shard_over_eight(name: str) -> None:
    config = ModelConfig.from_pretrained(REFERENCE / f"{name}.config.json")
    check_checkpoint_layout(config, tensor_parallel_size=8)
    model = build_model(
        config, max_positions=1, dtype=torch.bfloat16, device="meta", tp=TPGroup(7, 8)
    )
    assert model.attention_shape.num_kv_heads == 1
    assert model.model.embed_tokens.weight.shape == (config.vocab_size // 8, config.hidden_size)
    attn = model.model.layers[0].self_attn
    assert attn.qkv_proj.weight.shape[0] == (4 + 1 + 1) * config.head_dim
    assert attn.o_proj.weight.shape == (config.hidden_size, 4 * config.head_dim)
