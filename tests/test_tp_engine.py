"""The engine over two tensor-parallel ranks (gloo, CPU, float32) against the engine over one.

Rank 0 builds the engine and serves staggered requests through the scheduler's loop; rank 1
builds a follower and runs the plans rank 0 sends. Tokens (greedy and seeded sampled) must
equal those of the same requests on one rank, with and without speculative decoding, overlap
on and off; both ranks must have run the same steps and drafted the drafts of one rank (the
drafts decide no token: their equality is what shows the sharded drafts right), and each
rank's draft model must hold its shard (half the heads, MLP rows and draft vocabulary).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from daemon_harness import free_port
from engine_harness import debug_checks_fixture, engine_for, request, run, tokens_of
from model_fixtures import (
    TINY,
    VOCAB,
    save_random_dflash,
    save_random_eagle3,
    save_tiny_model,
)

from outrider.daemon.cli.main import main
from outrider.daemon.config import EXIT_CONFIG, ServeConfig
from outrider.daemon.engine.build import build_engine, build_follower
from outrider.daemon.engine.plan import StepPlan
from outrider.daemon.engine.ranks import RankChannel
from outrider.daemon.engine.runner import ModelRunner
from outrider.daemon.engine.step_memory import SAMPLING_BYTES_PER_LOGIT, graph_pool_bytes
from outrider.daemon.internal import TokenizedRequest
from outrider.daemon.processes.preflight import preflight
from outrider.daemon.scheduler.loop import StepFailed
from outrider.plugins.models.config import ModelConfig, kv_bytes_per_token
from outrider.plugins.models.layers import MLP, Attention
from outrider.plugins.models.parallel import SINGLE, TPGroup, init_tensor_parallel
from outrider.plugins.speculative.base import DecodeView, Drafts, SpeculativeWorker
from outrider.plugins.speculative.dflash_impl import DFlashWorker
from outrider.plugins.speculative.eagle3_impl import Eagle3Worker
from outrider.plugins.speculative.standalone_impl import StandaloneWorker

WORLD = 2
STAGGER = 2
NEW_TOKENS = 8

debug_checks = debug_checks_fixture()


def _requests() -> list[TokenizedRequest]:
    """Four greedy prompts (one past a prefill chunk) and a seeded sampled one."""
    rng = random.Random(16)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 40, 12, 23, 9)]
    greedy = [request(i, p, max_new_tokens=NEW_TOKENS) for i, p in enumerate(prompts[:4])]
    sampled = request(4, prompts[4], max_new_tokens=NEW_TOKENS, temperature=0.9, top_k=20, seed=5)
    return [*greedy, sampled]


def _settings(model: str, overlap: bool, **changes: object) -> dict[str, Any]:
    return {
        "model": model,
        "page_size": 16,
        "max_running": 4,
        "kv_cache_tokens": 1024,
        "chunked_prefill_tokens": 32,
        "speculative_min_acceptance": 0.0,
        "no_overlap": not overlap,
        **changes,
    }


def _draft_shapes(runner: ModelRunner) -> dict[str, list[int]]:
    """The weight shapes of the rank's draft (its first attention and MLP, an EAGLE-3
    draft's head) and the KV heads of its cache; empty without a draft model. Checks, on the
    rank, that the draft's KV and attention shape are its layers' heads."""
    worker = runner.worker
    if not isinstance(worker, (Eagle3Worker, DFlashWorker, StandaloneWorker)):
        return {}
    modules = list(worker.model.modules())
    attn = next(m for m in modules if isinstance(m, Attention))
    mlp = next(m for m in modules if isinstance(m, MLP))
    kv_heads = worker.kv.k[0].shape[2]
    assert kv_heads == attn.num_kv_heads == worker.model.attention_shape.num_kv_heads
    assert worker.model.attention_shape.num_q_heads == attn.num_q_heads
    shapes = {
        "qkv_proj": list(attn.qkv_proj.weight.shape),
        "o_proj": list(attn.o_proj.weight.shape),
        "gate_up_proj": list(mlp.gate_up_proj.weight.shape),
        "down_proj": list(mlp.down_proj.weight.shape),
        "kv_heads": [kv_heads],
    }
    if isinstance(worker, Eagle3Worker):
        shapes["lm_head"] = list(worker.model.lm_head.weight.shape)
    return shapes


def _serve(settings: dict[str, Any], tp: TPGroup) -> dict[str, Any]:
    """Tokens per request id, and the rank's draft shapes (``_draft_shapes``)."""
    engine = build_engine(ServeConfig(**settings, tensor_parallel_size=tp.size), tp=tp)
    kv_heads = json.loads((Path(settings["model"]) / "config.json").read_text())
    assert engine.loop.runner.kv.k[0].shape[2] == kv_heads["num_key_value_heads"] // tp.size
    shapes = _draft_shapes(engine.loop.runner)
    tokens = tokens_of(run(engine, _requests(), stagger=STAGGER))
    engine.stop_ranks()
    return {"tokens": tokens, "draft": shapes}


def _record_drafts(patch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """Every draft model worker's drafts (a tree's parents after its tokens), in order, from
    now on, in the list returned."""
    drafted: list[torch.Tensor] = []
    for worker_class in (Eagle3Worker, DFlashWorker, StandaloneWorker):
        original = worker_class.draft

        def recorded(
            worker: SpeculativeWorker, view: DecodeView, original: Any = original
        ) -> Drafts:
            drafts: Drafts = original(worker, view)
            parts = [drafts.tokens] if drafts.parents is None else [drafts.tokens, drafts.parents]
            drafted.append(torch.cat(parts, dim=1).clone())
            return drafts

        patch.setattr(worker_class, "draft", recorded)
    return drafted


def _rank_main(
    rank: int, port: int, world: int, cells: dict[str, dict[str, Any]], out: Path
) -> None:
    torch.set_num_threads(1)
    tp = init_tensor_parallel(rank, world, f"tcp://127.0.0.1:{port}", "gloo")
    sent = 0
    send = RankChannel.send

    def counted(channel: RankChannel, plan: StepPlan) -> None:
        nonlocal sent
        sent += 1
        send(channel, plan)

    seen: dict[str, Any] = {}
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(RankChannel, "send", counted)  # counts rank 0's plans
            for name, settings in cells.items():
                drafted = _record_drafts(patch)
                if rank == 0:
                    sent = 0
                    seen[name] = _serve(settings, tp) | {"steps": sent}
                else:
                    config = ServeConfig(**settings, tensor_parallel_size=world)
                    follower = build_follower(config, tp)
                    shapes = _draft_shapes(follower.runner)
                    seen[name] = {"steps": follower.run(), "draft": shapes}
                seen[name]["drafted"] = [d.tolist() for d in drafted]
        (out / f"rank{rank}.json").write_text(json.dumps(seen))
        # NOTE: leave as the daemon's ranks do (processes/ranks.py), without the interpreter's
        # teardown: gloo's objects destroyed at exit aborted a rank that had saved its results
        # ("terminate called without an active exception", once in CI).
        os._exit(0)
    finally:
        dist.destroy_process_group()


# Where a rank's share of each draft weight (and KV heads) that one rank holds whole is cut:
# qkv and gate/up and the head split their rows, o_proj and down_proj their columns.
_SHARDED_DIM = {
    "qkv_proj": 0,
    "o_proj": 1,
    "gate_up_proj": 0,
    "down_proj": 1,
    "kv_heads": 0,
    "lm_head": 0,
}


def _shard(shape: list[int], dim: int, world: int) -> list[int]:
    return [n // world if d == dim else n for d, n in enumerate(shape)]


def test_two_ranks_serve_the_tokens_of_one(
    llama_dir: str,
    eagle3_dir: str,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dflash_dir = str(save_random_dflash(tmp_path_factory.mktemp("dflash")))
    standalone_dir = tmp_path_factory.mktemp("qwen2-draft")
    with torch.no_grad():
        save_tiny_model("qwen2", standalone_dir)
    eagle3 = {"speculative_algorithm": "eagle3", "draft_model": eagle3_dir}
    algorithms: dict[str, tuple[dict[str, object], tuple[bool, ...]]] = {
        "none": ({}, (True, False)),
        "eagle3": (eagle3 | {"speculative_num_steps": 3}, (True, False)),
        "dflash": ({"speculative_algorithm": "dflash", "draft_model": dflash_dir}, (True, False)),
        # A top-2 tree: vocab_top_logprobs with K > 1.
        "eagle3_tree": (
            eagle3
            | {
                "speculative_num_steps": 3,
                "speculative_topk": 2,
                "speculative_num_draft_tokens": 5,
            },
            (True,),
        ),
        "standalone": (
            {"speculative_algorithm": "standalone", "draft_model": str(standalone_dir)},
            (False,),
        ),
    }
    cells = {
        f"{name}-{'overlap' if overlap else 'serial'}": _settings(llama_dir, overlap, **spec)
        for name, (spec, overlaps) in algorithms.items()
        for overlap in overlaps
    }
    # gpt-oss with its sliding layers in window pages: the plans' window writes, every rank's.
    gpt_oss_dir = tmp_path_factory.mktemp("gpt_oss")
    with torch.no_grad():
        save_tiny_model("gpt_oss", gpt_oss_dir)
    cells["gpt_oss-windowed"] = _settings(
        str(gpt_oss_dir), True, page_size=4, chunked_prefill_tokens=8
    )
    _check_ranks(cells, WORLD, tmp_path_factory, monkeypatch)


def test_four_ranks_serve_gpt_oss_with_eagle3_as_one(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gpt-oss over four ranks (a quarter of the heads each, one expert each, window pages)
    with EAGLE-3 in the two configurations the FA4 work was validated with (3 steps, top-1,
    4 draft tokens; 6 steps, top-10, 32 draft tokens), its draft shaped as gpt-oss's
    published drafts are (heads wider than the hidden size: 8 of 16 over 64; its taps
    normalized before fc), sharded four ways: the tokens and drafts of one rank."""
    heads = {"num_attention_heads": 8, "num_key_value_heads": 4}
    target = tmp_path_factory.mktemp("gpt_oss_tp4")
    with torch.no_grad():
        # A vocabulary whose draft half (152) four ranks divide.
        save_tiny_model("gpt_oss", target, vocab_size=304, config_overrides=heads)
    draft = save_random_eagle3(
        tmp_path_factory.mktemp("gpt_oss_tp4_draft"),
        target,
        heads | {"head_dim": 16, "norm_before_fc": True},
    )
    cells = {
        f"gpt_oss-eagle3-{steps}/{topk}/{tokens}": _settings(
            str(target),
            True,
            page_size=4,
            chunked_prefill_tokens=8,
            speculative_algorithm="eagle3",
            draft_model=str(draft),
            speculative_num_steps=steps,
            speculative_topk=topk,
            speculative_num_draft_tokens=tokens,
        )
        for steps, topk, tokens in ((3, 1, 4), (6, 10, 32))
    }
    _check_ranks(cells, 4, tmp_path_factory, monkeypatch)


def _check_ranks(
    cells: dict[str, dict[str, Any]],
    world: int,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``cells`` served over ``world`` ranks (rank 0 leading, the others following) against
    one rank: the same tokens, steps and drafts on every rank, each rank's draft its shard."""
    out = tmp_path_factory.mktemp("ranks")
    mp.spawn(_rank_main, args=(free_port(), world, cells, out), nprocs=world, join=True)
    torch.set_num_threads(1)
    ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world)]
    leader = ranks[0]
    for name, settings in cells.items():
        drafted = _record_drafts(monkeypatch)
        single = _serve(settings, SINGLE)
        expected = single["tokens"]
        assert {int(rid): ids for rid, ids in leader[name]["tokens"].items()} == expected, name
        assert all(len(ids) == NEW_TOKENS for ids in expected.values())
        whole = single["draft"]
        assert bool(whole) == ("draft_model" in settings), name
        shards = {key: _shard(shape, _SHARDED_DIM[key], world) for key, shape in whole.items()}
        assert bool(drafted) == bool(whole), name
        drafts = [d.tolist() for d in drafted]
        for rank in ranks:
            assert rank[name]["steps"] == leader[name]["steps"] > 0, name
            assert rank[name]["draft"] == shards, name
            assert rank[name]["drafted"] == drafts, name


def test_preflight_refuses_what_does_not_divide(
    llama_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert preflight(ServeConfig(model=llama_dir)) == []
    assert preflight(ServeConfig(model=llama_dir, tensor_parallel_size=2)) == []
    assert preflight(ServeConfig(model=llama_dir, tensor_parallel_size=4)) == [
        "--tensor-parallel-size 4 does not divide the model's num_key_value_heads (2): "
        "each rank takes an equal share"
    ]
    assert main(["serve", "--model", llama_dir, "--tp", "3"]) == EXIT_CONFIG
    refused = capsys.readouterr().err
    assert "--tensor-parallel-size 3 does not divide the model's num_attention_heads (4)" in refused


def test_sizes_are_per_rank() -> None:
    model = ModelConfig.from_dict(
        TINY | {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    )
    # 3 layers x K and V x 1 of 2 KV heads x 16 x 4 B
    assert kv_bytes_per_token(model, "float32", 2) == 3 * 2 * 16 * 4
    assert kv_bytes_per_token(model, "float32") == 2 * 3 * 2 * 16 * 4
    # 4 tokens x (4 B x (3 x 64 hidden + 2 x 32 q + 2 x 16 kv) + 4 B x 64 + 4 B x 3 x 48)
    layer = 4 * (4 * (192 + 64 + 32) + 256 + 4 * 3 * 48)
    # the rank's slice of the head's output, the gathered logits, their float32 copy, sampling
    logits = 4 * 300 * (2 + 4 + 4 + SAMPLING_BYTES_PER_LOGIT)
    assert graph_pool_bytes(model, 4, bs=4, width=1, kv_bound=None, tensor_parallel_size=2) == (
        layer + logits
    )


class _SilentChannel:
    """Stands for rank 0's channel to ranks that are not there."""

    leader = True

    def send(self, plan: object) -> None:
        pass


def test_a_failed_step_of_ranks_is_fatal(llama_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = engine_for(llama_dir, max_running=2, kv_cache_tokens=256)
    runner = engine.loop.runner

    def broken(*args: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(runner, "_launch", broken)
    runner.lead(_SilentChannel())  # type: ignore[arg-type]  # no other ranks
    engine.scheduler.add(request(0, [5, 6, 7]))
    with pytest.raises(StepFailed, match="a step of tensor-parallel ranks failed: boom"):
        engine.loop.iterate()


def test_a_draft_that_does_not_divide_is_refused_before_loading(
    llama_dir: str, eagle3_dir: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    draft = tmp_path / "eagle3"
    shutil.copytree(eagle3_dir, draft)
    config = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps(config | {"draft_vocab_size": 149}))
    flags = ["--model", llama_dir, "--speculative-algorithm", "eagle3", "--draft-model", str(draft)]
    assert main(["plugins", "--check", *flags, "--tp", "2"]) == EXIT_CONFIG
    refusal = (
        "--tensor-parallel-size: 2 does not divide the EAGLE-3 draft's draft_vocab_size (149): "
        "each rank takes an equal share"
    )
    assert refusal in capsys.readouterr().out
    assert main(["serve", *flags, "--tp", "2"]) == EXIT_CONFIG
    assert refusal in capsys.readouterr().err
    assert main(["plugins", "--check", *flags]) == 0  # one rank takes it whole
