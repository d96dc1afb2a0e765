"""benchmarks/speculation_sweep.py: which daemons the sweep starts, with which flags, and each
run's ratio to ``none`` on its own target at its concurrency."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from benchmark_scripts import benchmark_script


@pytest.fixture(scope="module")
def sweep() -> Iterator[ModuleType]:
    with benchmark_script("speculation_sweep") as module:
        yield module


def test_none_first_on_each_target_then_each_algorithm_at_each_acceptance(
    sweep: ModuleType,
) -> None:
    _, algorithms = sweep.dummy_shape()
    names = [mode.name for mode in sweep.modes(algorithms, ["dflash", "chain"], [2.0, 4.0])]
    assert names == [
        "llama-none", "llama-chain-a2", "llama-chain-a4",
        "qwen3-none", "qwen3-dflash-a2", "qwen3-dflash-a4",
    ]  # fmt: skip
    _, family = sweep.family_shape()
    names = [mode.name for mode in sweep.modes(family, ["tree", "ngram"], [2.0, 4.0])]
    assert names == ["family-none", "family-tree", "family-ngram"]  # real drafts: no simulation


def test_the_moe_target_serves_every_algorithm_with_drafts_of_its_sizes(
    sweep: ModuleType,
) -> None:
    import torch

    from outrider.plugins.api import CheckContext
    from outrider.plugins.models.config import ModelConfig
    from outrider.plugins.speculative import dflash, eagle3
    from outrider.plugins.speculative.dflash_model import DFlashConfig, build_dflash
    from outrider.plugins.speculative.eagle3_model import Eagle3Config, build_eagle3

    targets, algorithms = sweep.moe_shape()
    names = [mode.name for mode in sweep.modes(algorithms, ["chain", "dflash"], [2.0])]
    assert names == ["moe-none", "moe-chain-a2", "moe-dflash-a2"]
    target = ModelConfig.from_pretrained(targets["moe"][1])
    assert target.model_type == "qwen3_moe"
    for name, spec, width in (("chain", eagle3.SPEC, 4), ("dflash", dflash.SPEC, 16)):
        draft = algorithms[name].flags[algorithms[name].flags.index("--draft-model") + 1]
        ctx = CheckContext(
            "cuda", "bfloat16", 16, True, {}, spec.name, (9, 0), model=targets["moe"][1],
            speculative_num_draft_tokens=width, draft_model=draft,
        )  # fmt: skip
        assert spec.check(spec, ctx) == [], name
    # The 8B shape's DFlash draft is refused here (features of 4,096, a 36-layer target).
    ctx = CheckContext(
        "cuda", "bfloat16", 16, True, {}, "dflash", (9, 0), model=targets["moe"][1],
        draft_model=str(sweep.CONFIGS / "Qwen3-8B-DFlash-b16.config.json"),
    )  # fmt: skip
    assert [p.message for p in dflash.SPEC.check(dflash.SPEC, ctx)] == [
        "the draft reads target features of size 4096, the target's hidden_size is 2048",
        "the draft was made for a 36-layer target, this one has 48",
    ]
    # Both build at the target's hidden size, with its head layout.
    meta = {"max_positions": 1, "dtype": torch.bfloat16, "device": "meta"}
    eagle = build_eagle3(Eagle3Config.from_pretrained(algorithms["chain"].flags[3]), **meta)
    assert eagle.attention_shape.num_kv_heads == target.num_kv_heads
    assert eagle.attention_shape.head_dim == target.head_dim
    block = DFlashConfig.from_pretrained(algorithms["dflash"].flags[3])
    assert block.target_hidden_size == target.hidden_size and block.block_size == 16
    assert block.target_layer_ids == (1, 12, 23, 34, 45)
    assert build_dflash(block, **meta).num_kv_heads == target.num_kv_heads


def test_a_daemons_flags_hold_its_algorithm_acceptance_and_sizes(
    sweep: ModuleType, tmp_path: Path
) -> None:
    targets, algorithms = sweep.dummy_shape()
    args = argparse.Namespace(
        device="cuda", concurrency=[1, 64], step_logs=tmp_path, serve_args=["--max-prompt-run", "2"]
    )
    mode = sweep.Mode("qwen3", "dflash", 2.0)
    command = sweep.serve_command(mode, targets, algorithms, "ipc:///x", args)
    flags = " ".join(command[command.index("serve") + 1 :])
    assert flags == (
        f"--listen ipc:///x --device cuda --model {sweep.CONFIGS}/Qwen3-8B.config.json "
        "--load-format dummy --dtype bfloat16 --max-running 64 --cuda-graph-max-bs 64 "
        "--speculative-algorithm dflash --draft-model "
        f"{sweep.CONFIGS}/Qwen3-8B-DFlash-b16.config.json --speculative-simulate-acceptance 2 "
        f"--step-log {tmp_path}/qwen3-dflash-a2.jsonl --max-prompt-run 2"
    )
    none = sweep.serve_command(sweep.Mode("qwen3", "none", None), targets, algorithms, "e", args)
    assert "--speculative-algorithm none" in " ".join(none)
    assert "--speculative-simulate-acceptance" not in none


def test_each_run_is_compared_with_none_on_its_target_at_its_concurrency(sweep: ModuleType) -> None:
    def row(target: str, algorithm: str, concurrency: int, tok_s: float) -> dict:
        return {"mode": f"{target}-{algorithm}", "target": target, "algorithm": algorithm,
                "concurrency": concurrency, "output_throughput": tok_s,
                "p99_itl_ms": 1.0, "p99_tpot_ms": 1.0}  # fmt: skip

    rows = [
        row("llama", "none", 1, 100.0), row("llama", "none", 8, 400.0),
        row("qwen3", "none", 1, 50.0), row("llama", "chain", 1, 150.0),
        row("llama", "chain", 8, 392.0), row("qwen3", "dflash", 1, 75.0),
        row("qwen3", "dflash", 8, 300.0),
    ]  # fmt: skip
    assert [r["ratio"] for r in sweep.ratios(rows)] == [1.0, 1.0, 1.0, 1.5, 0.98, 1.5, None]
    lines = sweep.table(rows).splitlines()
    assert len(lines) == 8 and lines[-1].split()[:4] == ["qwen3-dflash", "8", "300.0", "-"]


def test_each_concurrency_draws_its_own_prompts(sweep: ModuleType) -> None:
    args = argparse.Namespace(input_len=512, output_len=128, tokenizer=Path("/tok"))
    runs = {c: sweep.bench_command("ipc:///x", c, "/r.json", args) for c in (1, 8)}
    flags = " ".join(runs[8][runs[8].index("serve") + 1 :])
    assert flags == (
        "--endpoint ipc:///x --dataset random --random-input-len 512 --random-output-len 128 "
        "--num-prompts 16 --max-concurrency 8 --seed 8 --result-json /r.json --tokenizer /tok"
    )
    assert runs[1][runs[1].index("--seed") + 1] == "1"  # not the prompts (or cache) of 8


def test_fixed_widths_draft_every_batch_at_each_width(sweep: ModuleType, tmp_path: Path) -> None:
    targets, algorithms = sweep.dummy_shape()
    chosen = sweep.modes(algorithms, ["chain", "dflash"], [2.0], fixed=[2, 4])
    assert [mode.name for mode in chosen] == [
        "llama-none", "llama-chain-a2", "llama-chain-a2-n2", "llama-chain-a2-n4",
        "qwen3-none", "qwen3-dflash-a2", "qwen3-dflash-a2-whole",  # its block, once
    ]  # fmt: skip
    args = argparse.Namespace(device="cuda", concurrency=[1], step_logs=None, serve_args=[])

    def tail(mode: object) -> list[str]:
        command = sweep.serve_command(mode, targets, algorithms, "e", args)
        return command[command.index("--speculative-simulate-acceptance") :]

    # The chain's steps are N - 1, after its own 3 (the last of a flag counts); a tree's and
    # n-gram's width is N itself.
    assert tail(chosen[3]) == [
        "--speculative-simulate-acceptance", "2", "--speculative-min-acceptance", "0",
        "--speculative-num-steps", "3",
    ]  # fmt: skip
    assert tail(chosen[6]) == [
        "--speculative-simulate-acceptance", "2", "--speculative-min-acceptance", "0"
    ]  # fmt: skip
    tree = sweep.Mode("llama", "tree", 4.0, 9)
    assert tail(tree)[-2:] == ["--speculative-num-draft-tokens", "9"]
    assert tail(tree)[:2] == ["--speculative-simulate-acceptance", "4"]  # not a chain
    assert tail(chosen[1]) == ["--speculative-simulate-acceptance", "2"]  # the policy chooses


def test_a_fixed_chain_is_the_policy_daemons_draft_cut_short(sweep: ModuleType) -> None:
    """At acceptance 2 the chain of 3 drafts accepts each position with p = 0.54369 (1 + p +
    p^2 + p^3 = 2): cut to one draft it commits 1 + p, to two 1 + p + p^2; n-gram's chain of
    7 drafts (its default width of 8) has p = 0.50202."""
    targets, algorithms = sweep.dummy_shape()
    args = argparse.Namespace(device="cuda", concurrency=[1], step_logs=None, serve_args=[])

    def simulated(algorithm: str, fixed: int | None) -> str:
        mode = sweep.Mode("llama", algorithm, 2.0, fixed)
        command = sweep.serve_command(mode, targets, algorithms, "e", args)
        return command[command.index("--speculative-simulate-acceptance") + 1]

    assert [simulated("chain", n) for n in (None, 2, 3, 4)] == ["2", "1.54369", "1.83929", "2"]
    assert [simulated("ngram", n) for n in (None, 2, 8)] == ["2", "1.50202", "2"]
    assert simulated("chain", 5) == "2.08738"  # p^4 past the policy's chain: the same draft


def test_each_run_gets_the_turns_its_daemon_took_while_it_ran(sweep: ModuleType) -> None:
    """Two runs on one daemon: each result holds the step log's turns of its own span, by
    kind; the turns table describes them run by run."""

    def line(at: float, kind: str, rows: int, width: int = 0) -> dict:
        return {"at": at, "turn_ms": 10.0 * rows, "wait_ms": 4.0 * rows, "kind": kind,
                "rows": rows, "width": width, "riders": 0, "unfed": 0}  # fmt: skip

    log = [
        line(1.0, "extend", 1), line(2.0, "decode", 1, 4), {"at": 2.5, "turn_ms": 0.1},
        line(10.0, "extend", 2), line(11.0, "decode", 2, 1), line(12.0, "decode", 2, 1),
        line(20.0, "decode", 3, 1),  # after the last run (its daemon draining)
    ]  # fmt: skip
    first = {"mode": "llama-chain-a2", "concurrency": 1}
    second = {"mode": "llama-chain-a2", "concurrency": 2}
    sweep.attach_turns([(first, 0.5, 3.0), (second, 9.5, 12.5)], log)
    one = {"turns": 1, "ms": 10.0, "waited_ms": 4.0, "rows": 1, "unfed": 0, "allocator_calls": 0}
    assert first["turns"] == {"prompt": one, "decode 4": one}
    assert second["turns"]["decode 1"] == one | {"turns": 2, "ms": 40.0, "waited_ms": 16.0,
                                                 "rows": 4}  # fmt: skip
    assert sweep.turns_table([first, second, {"mode": "x", "concurrency": 3}]).splitlines() == [
        "llama-chain-a2            1  prompt 1 x 10.0 ms, waited 4.0 (1.0 rows); decode 4 1 x "
        "10.0 ms, waited 4.0 (1.0 rows)",
        "llama-chain-a2            2  prompt 1 x 20.0 ms, waited 8.0 (2.0 rows); decode 1 2 x "
        "20.0 ms, waited 8.0 (2.0 rows)",
    ]
