"""Tensor-parallel models over torch.distributed (gloo, CPU, float32): two ranks against one.

Each rank loads its shard of the tiny checkpoints (and of dummy weights), runs a batch of
prompts and a few greedy decode steps over its own KV cache (its KV heads only), and writes
what it saw; the test compares that with the same run in a world of one.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import CONFIGS
from daemon_harness import free_port
from model_fixtures import TINY, VOCAB, PagedRows, save_tiny_model, torch_backend

from outrider.plugins.models.config import ModelConfig, tensor_parallel_problems
from outrider.plugins.models.loader import build_model, check_checkpoint_layout, load_model
from outrider.plugins.models.parallel import (
    SINGLE,
    TPGroup,
    gather_vocab,
    init_tensor_parallel,
    vocab_argmax,
    vocab_top_logprobs,
)
from outrider.plugins.speculative.dflash_model import DFlashConfig, build_dflash
from outrider.plugins.speculative.eagle3_model import Eagle3Config, build_eagle3

WORLD = 2
ATOL = 1e-5
PROMPTS = ((0, 11), (3, 6), (5, 17))  # (slot, prompt length)
DECODE_STEPS = 3
# (checkpoint, load format): llama with biases on q/k/v and o_proj (the row-parallel bias),
# qwen2 (q/k/v bias only), qwen3 (q/k norm, head_dim 24, tied embeddings), and qwen3's
# dummy weights; qwen2_moe, its experts and shared expert cut per rank, its layer 1 dense (each
# block's output summed once, in the next norm, whichever block it is); gpt-oss (sinks cut by
# heads, experts held whole by one rank each) in 16 bits and with dummy mxfp4 experts.
CASES: tuple[tuple[str, Literal["auto", "dummy"]], ...] = (
    ("llama", "auto"),
    ("qwen2", "auto"),
    ("qwen3", "auto"),
    ("qwen3", "dummy"),
    ("qwen2_moe", "auto"),
    ("gpt_oss", "auto"),
    ("gpt_oss_mxfp4", "dummy"),
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
    save_tiny_model("qwen2_moe", root / "qwen2_moe", config_overrides={"mlp_only_layers": [1]})
    save_tiny_model("gpt_oss", root / "gpt_oss")
    (root / "gpt_oss_mxfp4").mkdir()
    config = json.loads((root / "gpt_oss" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (root / "gpt_oss_mxfp4" / "config.json").write_text(json.dumps(config))


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


def _full_logits() -> torch.Tensor:
    """``[4, VOCAB]`` random logits (the same on every rank); row 3 ties at its maximum
    across the ranks' slices."""
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(11))
    logits[3, 7] = logits[3, VOCAB - 3] = logits[3].max() + 1.0
    return logits


def _top_logprobs(tp: TPGroup) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """``vocab_top_logprobs`` of the rank's slice of ``_full_logits`` for K = 1 and 3."""
    width = VOCAB // tp.size
    local = _full_logits()[:, tp.rank * width : (tp.rank + 1) * width]
    tops = {k: vocab_top_logprobs(local, k, tp) for k in (1, 3)}
    return {k: (top.logprobs, top.ids) for k, top in tops.items()}


def _rank_main(rank: int, port: int, root: Path) -> None:
    torch.set_num_threads(1)
    tp = init_tensor_parallel(rank, WORLD, f"tcp://127.0.0.1:{port}", "gloo")
    try:
        traces = {case: _run(root / case[0], case[1], tp) for case in CASES}
        seen = {"traces": traces, "ties": _argmax_ties(tp), "top": _top_logprobs(tp)}
        torch.save(seen, root / f"rank{rank}.pt")
        # NOTE: leave as the daemon's ranks do (processes/ranks.py), without the interpreter's
        # teardown: gloo's objects destroyed at exit aborted a rank that had saved its results
        # ("terminate called without an active exception", once in CI).
        os._exit(0)
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
        # The whole vocabulary's log-softmax top-K, without gathering it (rows 0-2); row 3's
        # tie goes to the lowest id, as argmax's (a world of one runs topk: no tie rule).
        for k, (logprobs, ids) in seen["top"].items():
            ref = _top_logprobs(SINGLE)[k]
            torch.testing.assert_close(logprobs, ref[0], atol=ATOL, rtol=0)
            assert torch.equal(ids[:3], ref[1][:3]), (k, rank)
            assert ids[3, :2].tolist() == [7, VOCAB - 3][:k], (k, rank)
        assert _full_logits()[3].argmax() == 7
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


def _draft_dict(architecture: str, model_type: str, **changes: object) -> dict[str, object]:
    return TINY | {"architectures": [architecture], "model_type": model_type} | changes


def test_drafts_refuse_what_does_not_divide() -> None:
    eagle3 = Eagle3Config.from_dict(
        _draft_dict("LlamaForCausalLMEagle3", "llama", num_hidden_layers=1, draft_vocab_size=149)
    )
    with pytest.raises(ValueError) as refused:
        build_eagle3(eagle3, max_positions=1, dtype=torch.float32, device="meta", tp=TPGroup(0, 2))
    assert str(refused.value) == (
        "--tensor-parallel-size 2 does not divide the EAGLE-3 draft's draft_vocab_size (149): "
        "each rank takes an equal share"
    )
    dflash = DFlashConfig.from_dict(
        _draft_dict(
            "DFlashDraftModel",
            "qwen3",
            num_key_value_heads=1,
            block_size=4,
            num_target_layers=3,
            dflash_config={"mask_token_id": 0, "target_layer_ids": [0, 1]},
        )
    )
    with pytest.raises(ValueError) as refused:
        build_dflash(dflash, max_positions=1, dtype=torch.float32, device="meta", tp=TPGroup(1, 2))
    assert str(refused.value) == (
        "--tensor-parallel-size 2 does not divide the DFlash draft's num_key_value_heads (1): "
        "each rank takes an equal share"
    )
    # What divides builds the rank's shard: half the heads, the MLP rows, the draft vocab.
    eagle3 = Eagle3Config.from_dict(
        _draft_dict("LlamaForCausalLMEagle3", "llama", num_hidden_layers=1, draft_vocab_size=150)
    )
    draft = build_eagle3(
        eagle3, max_positions=1, dtype=torch.float32, device="meta", tp=TPGroup(1, 2)
    )
    assert draft.attention_shape.num_q_heads == 2 and draft.num_kv_heads == 1
    assert draft.midlayer.self_attn.qkv_proj.weight.shape == ((2 + 1 + 1) * 16, 2 * 64)
    assert draft.midlayer.mlp.down_proj.weight.shape == (64, 48)
    assert draft.lm_head.weight.shape == (75, 64)


@pytest.mark.parametrize("name", ["Qwen3-8B", "Llama-3.1-8B-Instruct"])
def test_reference_configs_shard_over_eight(name: str) -> None:
    config = ModelConfig.from_pretrained(CONFIGS / f"{name}.config.json")
    check_checkpoint_layout(config, tensor_parallel_size=8)
    model = build_model(
        config, max_positions=1, dtype=torch.bfloat16, device="meta", tp=TPGroup(7, 8)
    )
    assert model.attention_shape.num_kv_heads == 1
    assert model.model.embed_tokens.weight.shape == (config.vocab_size // 8, config.hidden_size)
    attn = model.model.layers[0].self_attn
    assert attn.qkv_proj.weight.shape[0] == (4 + 1 + 1) * config.head_dim
    assert attn.o_proj.weight.shape == (config.hidden_size, 4 * config.head_dim)
