"""``outrider bench latency`` and the simulated acceptance it uses with dummy weights."""

from __future__ import annotations

import argparse
import json
import random
from typing import Any

import pytest
import torch
from conftest import CONFIGS
from engine_harness import (
    debug_checks_fixture,
    engine_for,
    request,
    requests_for,
    run,
    tau_of,
)
from model_fixtures import VOCAB

from outrider.daemon.bench import latency as latency_module
from outrider.daemon.bench.latency_io import add_latency_arguments, resolve_latency
from outrider.daemon.cli.main import main
from outrider.daemon.config import EXIT_CONFIG
from outrider.daemon.engine.verify import SimulatedAcceptance, position_rate
from outrider.daemon.flags import SERVING_ONLY, add_serve_arguments, env_name, flag_name
from outrider.daemon.internal import TokenizedRequest
from outrider.plugins.api import StepShape
from outrider.plugins.sampling_spec import SamplingSpec
from outrider.plugins.speculative.base import Drafts

debug_checks = debug_checks_fixture()


def bench(capsys: pytest.CaptureFixture[str], *args: str) -> list[dict[str, object]]:
    assert main(["bench", "latency", "--json", *args]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_plain_decoding_takes_one_step_per_token(
    llama_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    threads = torch.get_num_threads()
    try:
        facts, *rows = bench(
            capsys, "--model", llama_dir, "--batch-size", "1", "3", "--input-len", "20",
            "--output-len", "9", "--threads", str(threads + 1),
        )  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    assert (facts["speculative"], facts["width"], facts["dtype"]) == ("none", 1, "float32")
    assert facts["sampling"] == "greedy"
    assert facts["torch_threads"] == threads + 1  # --threads, as serve takes it
    assert float(facts["read_bandwidth_gb_s"]) > 0  # type: ignore[arg-type]
    assert [row["batch"] for row in rows] == [1, 3]
    for row in rows:
        # The first token comes from the prefill; each decode step commits one more.
        assert (row["decode_steps"], row["tokens_per_step"]) == (8, 1.0)
        for key in ("prefill_ms", "step_ms", "decode_tok_s", "roofline_tok_s", "verify_ms"):
            assert row[key] > 0, key  # type: ignore[operator]
        assert row["percent_of_roofline"] == pytest.approx(
            100 * row["decode_tok_s"] / row["roofline_tok_s"]  # type: ignore[operator]
        )


def test_simulated_acceptance_drives_a_speculative_run(
    llama_dir: str, eagle3_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    facts, row = bench(
        capsys, "--model", llama_dir, "--speculative-algorithm", "eagle3", "--draft-model",
        eagle3_dir, "--speculative-num-steps", "3", "--speculative-simulate-acceptance", "4",
        "--input-len", "16", "--output-len", "41",
    )  # fmt: skip
    assert (facts["speculative"], facts["width"]) == ("eagle3", 4)
    # Every verify commits all four tokens: 40 tokens after the first in 10 steps.
    assert (row["decode_steps"], row["tokens_per_step"]) == (10, 4.0)
    assert row["draft_ms"] > 0 and row["catch_up_ms"] > 0  # type: ignore[operator]


@pytest.mark.parametrize(
    ("mean", "tree"), [(2.5, False), (1.0, False), (2.6, True)], ids=["chain", "none", "tree"]
)
def test_simulated_acceptance_has_the_asked_mean(
    llama_dir: str, eagle3_dir: str, mean: float, tree: bool
) -> None:
    """The committed tokens per verify average ``mean`` (before finish truncation), and the
    KV and relay checks hold: a tree's path along first children is compacted like any."""
    shape = {"speculative_num_steps": 3}
    if tree:
        shape |= {"speculative_topk": 2, "speculative_num_draft_tokens": 6}
    engine = engine_for(
        llama_dir, speculative_algorithm="eagle3", draft_model=eagle3_dir,
        speculative_simulate_acceptance=mean, **shape,
    )  # fmt: skip
    rng = random.Random(3)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(4, 30))] for _ in range(8)]
    run(engine, requests_for(prompts, max_new_tokens=60))
    counters = engine.scheduler.counters()
    assert counters.spec_drafts > 100
    assert tau_of(counters) == pytest.approx(mean, abs=0.15)


def test_simulated_acceptance_holds_for_rejection_sampled_drafts(
    llama_dir: str, eagle3_dir: str
) -> None:
    """Sampled rows whose drafts carry their probabilities (``"sample": "rejection"``) commit
    what the simulation says too, not what the dummy drafts would earn: at 4 every verify of
    a chain of 3 commits all four tokens."""
    engine = engine_for(
        llama_dir, speculative_algorithm="eagle3", draft_model=eagle3_dir,
        speculative_num_steps=3, speculative_config='{"sample": "rejection"}',
        speculative_simulate_acceptance=4.0,
    )  # fmt: skip
    requests = [
        request(i, [3 + i, 7, 9 + i], max_new_tokens=33, temperature=1.0, seed=i) for i in range(4)
    ]
    run(engine, requests)
    counters = engine.scheduler.counters()
    assert counters.spec_drafts == 4 * 8 and tau_of(counters) == 4.0


def test_a_simulated_chain_cut_short_accepts_what_the_whole_chain_accepts_of_it() -> None:
    """Each position is accepted with one probability until the first refused (2.5 at three
    drafts: 1 + p + p^2 + p^3 = 2.5); the same rows and steps cut to one or two drafts
    accept the whole chain's count capped at their depth."""
    shape = StepShape(width=4, depth=3, topk=1)
    p = position_rate(2.5, 3)
    assert 1 + p + p**2 + p**3 == pytest.approx(2.5)
    assert (position_rate(4.0, 3), position_rate(1.0, 3)) == (1.0, 0.0)
    simulated = SimulatedAcceptance(2.5, shape, torch.device("cpu"))
    rows = 4000
    seed, out_lens = torch.arange(rows), torch.arange(rows) % 7
    chain = Drafts(torch.zeros(rows, 3, dtype=torch.int64))
    whole, _ = simulated.accept(chain, shape, seed, out_lens)
    assert whole.float().mean().item() == pytest.approx(2.5, abs=0.05)
    for drafts in (1, 2):
        cut = shape.cut(drafts + 1)
        lens, path = simulated.accept(
            Drafts(torch.zeros(rows, drafts, dtype=torch.int64)), cut, seed, out_lens
        )
        assert torch.equal(lens, whole.clamp(max=drafts + 1))
        assert path.shape == (rows, drafts + 1)


def test_a_simulated_tree_accepts_along_its_deepest_path() -> None:
    """Node 1 (the first child) is a leaf; node 2's branch goes three deep: at 4.0 (three
    drafts) the path is 0, 2, 3, 5 whatever the order of the siblings, and a tree cut to the
    first four nodes (two deep) commits what its own deepest path holds."""
    shape = StepShape(width=7, depth=4, topk=2)
    simulated = SimulatedAcceptance(4.0, shape, torch.device("cpu"))
    #          node: 1  2  3  4  5  6
    parents = torch.tensor([[0, 0, 2, 2, 3, 1], [0, 0, 2, 2, 4, 1]])
    drafts = Drafts(torch.zeros(2, 6, dtype=torch.int64), parents=parents)
    seed, out_lens = torch.arange(2), torch.zeros(2, dtype=torch.int64)
    lens, path = simulated.accept(drafts, shape, seed, out_lens)
    assert lens.tolist() == [4, 4]
    assert path.tolist() == [[0, 2, 3, 5, 5], [0, 2, 4, 5, 5]]
    cut = Drafts(torch.zeros(2, 3, dtype=torch.int64), parents=parents[:, :3])
    lens, path = simulated.accept(cut, shape.cut(4), seed, out_lens)
    assert lens.tolist() == [3, 3] and path[:, :3].tolist() == [[0, 2, 3], [0, 2, 3]]


def test_simulated_acceptance_needs_a_speculative_algorithm(
    llama_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        ["bench", "latency", "--model", llama_dir, "--speculative-simulate-acceptance", "2"]
    )
    assert code == EXIT_CONFIG
    assert capsys.readouterr().err == (
        "outrider bench latency: --speculative-simulate-acceptance must be at least 1 (or 0: "
        "off) and needs a speculative algorithm\n"
    )


def test_profile_prints_the_top_operations(
    llama_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "latency", "--json", "--model", llama_dir, "--output-len", "3", "--profile"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 2  # the facts and one row: the profile stays off stdout
    assert "profile of batch 1 (prefill and decode) by host time:" in err and "aten::mm" in err
    assert "by device time" not in err  # no device on CPU


def test_the_rows_sample_as_asked_each_seeded_by_its_id(
    llama_dir: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[TokenizedRequest] = []
    make = latency_module.benchmark_request

    def recorded(*args: Any) -> TokenizedRequest:
        made.append(make(*args))
        return made[-1]

    monkeypatch.setattr(latency_module, "benchmark_request", recorded)
    argv = ["--model", llama_dir, "--output-len", "3", "--batch-size", "2"]
    facts, _ = bench(capsys, *argv)
    assert facts["sampling"] == "greedy"
    assert {r.sampling.temperature for r in made} == {0.0}
    made.clear()
    facts, _ = bench(capsys, *argv, "--temperature", "1", "--top-p", "0.9", "--top-k", "20")
    assert facts["sampling"] == "temperature 1, top-p 0.9, top-k 20"
    assert len(made) == 4  # the untimed run and the timed one, two rows each
    assert [r.sampling for r in made] == [
        SamplingSpec(1.0, top_p=0.9, top_k=20, seed=r.rid) for r in made
    ]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--temperature", "1e-6"],
            "--temperature must be 0 (greedy) or in [1e-05, 100], got 1e-06",
        ),
        (["--temperature", "101"], "--temperature must be in [0, 100], got 101.0"),
        (["--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
        (["--top-k", "-1"], "--top-k must be 0 (off) or more, got -1"),
    ],
)
def test_sampling_flags_out_of_range_are_refused(
    llama_dir: str, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    assert main(["bench", "latency", "--model", llama_dir, *flags]) == EXIT_CONFIG
    assert capsys.readouterr().err == f"outrider bench latency: {message}\n"


def test_runs_give_a_row_per_batch_and_input_length(
    llama_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    facts, *rows = bench(
        capsys, "--model", llama_dir, "--batch-size", "1", "2", "--input-len", "8", "16",
        "--output-len", "5", "--runs", "3",
    )  # fmt: skip
    assert facts["speculative"] == "none"
    assert [(row["batch"], row["input_len"]) for row in rows] == [(1, 8), (1, 16), (2, 8), (2, 16)]
    for row in rows:
        assert (row["runs"], row["decode_steps"], row["output_len"]) == (3, 4, 5)
        assert 0 < row["step_ms_min"] <= row["step_ms"] <= row["step_ms_max"]  # type: ignore[operator]
        assert row["decode_tok_s"] == pytest.approx(
            row["batch"] * 4 / (4 * row["step_ms"] / 1e3)  # type: ignore[operator]
        )


def test_a_row_is_the_run_of_median_step_time() -> None:
    """Every figure of a row comes from one run (the lower middle of an even count), the
    spread from all of them."""
    from outrider.daemon.bench.latency import Roofline, TimedRun, latency_row
    from outrider.daemon.bench.roofline import WeightBytes
    from outrider.daemon.engine.timing import PhaseTimes

    def timed(decode_ms: float, steps: int, prefill_ms: float) -> TimedRun:
        return TimedRun(prefill_ms, decode_ms, PhaseTimes(steps, 0.0, decode_ms, 0.0, 0.0))

    roofline = Roofline(bandwidth=1e9, weights=WeightBytes(10**6), kv_bytes_per_token=10**3)
    runs = [timed(40.0, 4, 1.0), timed(90.0, 3, 2.0), timed(44.0, 4, 3.0)]  # 10, 30, 11 ms
    row = latency_row(runs, roofline, batch=2, input_len=8, output_len=5)
    assert (row.runs, row.step_ms_min, row.step_ms, row.step_ms_max) == (3, 10.0, 11.0, 30.0)
    assert (row.prefill_ms, row.decode_steps, row.verify_ms) == (3.0, 4, 11.0)
    assert row.decode_tok_s == pytest.approx(2 * 4 / 0.044)
    assert row.roofline_tok_s == pytest.approx(2 * 1e9 / (10**6 + 2 * 10.5 * 10**3))
    even = latency_row([*runs[:2], timed(100.0, 4, 4.0)], roofline, 2, 8, 5)  # 10, 25, 30
    assert latency_row([*runs, timed(100.0, 4, 4.0)], roofline, 2, 8, 5).step_ms == 11.0
    assert even.step_ms == 25.0


def test_latency_takes_every_serve_flag_but_those_only_a_serving_daemon_uses(
    capsys: pytest.CaptureFixture[str],
) -> None:
    serve, latency = argparse.ArgumentParser(), argparse.ArgumentParser()
    add_serve_arguments(serve)
    add_latency_arguments(latency)
    serving_only = {flag_name(name) for name in SERVING_ONLY}
    assert {"--http", "--listen", "--api-key", "--drain-timeout"} <= serving_only
    assert set(serve._option_string_actions) - serving_only <= set(latency._option_string_actions)
    assert serving_only.isdisjoint(latency._option_string_actions)
    with pytest.raises(SystemExit):
        main(["bench", "latency", "--help"])
    assert "--http" not in capsys.readouterr().out
    with pytest.raises(SystemExit) as refused:
        main(["bench", "latency", "--http", "127.0.0.1:8000"])
    assert refused.value.code == 2
    assert capsys.readouterr().err.endswith(
        "outrider bench latency: error: unrecognized arguments: --http 127.0.0.1:8000\n"
    )


def test_latency_reads_no_variable_of_a_flag_it_leaves_out() -> None:
    parser = argparse.ArgumentParser()
    add_latency_arguments(parser)
    args = parser.parse_args(["--model", "/m", "--load-format", "dummy"])
    own = {"OUTRIDER_PAGE_SIZE": "32"}
    # Serve would refuse "1" as an endpoint or socket mode, and serve without sampling defaults.
    left_out = {env_name(name): "1" for name in SERVING_ONLY}
    left_out["OUTRIDER_GENERATION_CONFIG"] = "none"
    config = resolve_latency(args, own | left_out)
    assert config == resolve_latency(args, own)
    assert (config.page_size, config.generation_config, config.http) == (32, "auto", "")


def test_a_run_takes_its_own_flags_variables_only(
    llama_dir: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OUTRIDER_SPECULATIVE_ALGORITHM", "ngram")
    monkeypatch.setenv("OUTRIDER_HTTP", "not an endpoint")
    facts, row = bench(capsys, "--model", llama_dir, "--input-len", "8", "--output-len", "3")
    assert (facts["speculative"], row["output_len"]) == ("ngram", 3)


def test_a_moe_step_reads_the_experts_its_tokens_reach() -> None:
    """Qwen3-30B-A3B: 48 sparse layers of 128 experts (gate, up, down of 2,048 x 768), 8 a
    token; one token reads 8 experts a layer, a large batch nearly all of them."""
    from outrider.daemon.bench.roofline import experts_reached, step_weight_bytes, weight_bytes
    from outrider.plugins.models.config import ModelConfig

    path = CONFIGS / "Qwen3-30B-A3B.config.json"
    config = ModelConfig.from_dict(json.loads(path.read_text()))
    weights = step_weight_bytes(config, "bfloat16")
    assert weights.experts == 48 * 128 * 3 * 2048 * 768 * 2
    assert weights.total == weight_bytes(config, "bfloat16")
    assert (weights.num_experts, weights.top_k) == (128, 8)
    assert weights.per_step(1) == pytest.approx(weights.always + weights.experts * 8 / 128)
    assert experts_reached(2, 128, 8) == pytest.approx(128 * (1 - (120 / 128) ** 2))
    steps = [weights.per_step(tokens) for tokens in (1, 4, 32, 256, 4096)]
    assert steps == sorted(steps) and steps[-1] == pytest.approx(weights.total)
    dense = ModelConfig.from_dict(
        json.loads((path.parent / "Llama-3.1-8B-Instruct.config.json").read_text())
    )
    assert step_weight_bytes(dense, "bfloat16").per_step(64) == weight_bytes(dense, "bfloat16")
