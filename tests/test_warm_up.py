"""The warm-up before READY (daemon/engine/warm_up.py): its prompt ladder meets every launch
class of the ``triton`` attention a prompt batch can have, runs as the batches it names, and on
CUDA no kernel compiles once the engine serves."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from engine_harness import DRAFT_ALGORITHMS, ENGINE_ALGORITHMS, engine_for, request, run

from outrider.daemon.engine.warm_up import prompt_ladder, warm_up
from outrider.daemon.internal import TokenizedRequest
from outrider.daemon.scheduler.step_log import StepLog
from outrider.plugins.attention.triton_plan import MODE_CAUSAL, launch_plan


def test_the_ladder_doubles_the_longest_prompt_alone_and_beside_the_most_rows() -> None:
    assert prompt_ladder(8, 32, 255) == [
        (1, 1), (8, 1), (1, 2), (8, 2), (1, 4), (8, 4), (1, 8), (8, 8), (1, 16), (8, 16),
        (1, 32),
    ]  # fmt: skip
    # The context bounds the longest prompt; the budget, the rows beside it.
    assert prompt_ladder(256, 2048, 100)[-2:] == [(1, 100), (256, 100)]
    assert prompt_ladder(256, 300, 1000)[-3:] == [(1, 256), (45, 256), (1, 300)]
    assert prompt_ladder(8, 32, 0) == []  # a context of one token holds no prompt


def _launch_class(plan_args: dict[str, int], bs: int, max_q: int) -> tuple[int, bool, int]:
    plan = launch_plan(**plan_args, bs=bs, max_q=max_q, mode=MODE_CAUSAL)
    return plan.block_m, plan.merged, plan.stages()


@pytest.mark.parametrize(
    ("q_heads", "kv_heads", "head_dim", "programs_wanted", "max_rows", "budget", "classes"),
    [
        (32, 8, 128, 264, 256, 2048, 8),  # Llama-3.1-8B, Qwen3-8B on an H200
        (64, 8, 64, 264, 256, 2048, 8),  # gpt-oss (a group of 8)
        (28, 4, 128, 228, 20, 512, 5),  # a group of 7, an H100, too few rows to fill it
        (16, 16, 128, 264, 64, 1024, 8),  # no grouping
        (32, 1, 128, 264, 256, 2048, 6),  # one KV head: a query fills a tile of 32 pairs
    ],
)
def test_the_ladder_meets_every_triton_launch_class_of_a_prompt_batch(
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    programs_wanted: int,
    max_rows: int,
    budget: int,
    classes: int,
) -> None:
    """A prompt batch's launch depends on its rows and its longest row's queries; every batch
    the step's limits allow (rows - 1 + longest <= budget) has the class of one ladder batch."""
    plan_args = dict(
        num_q_heads=q_heads, num_kv_heads=kv_heads, head_dim=head_dim,
        programs_wanted=programs_wanted,
    )  # fmt: skip
    reachable = {
        _launch_class(plan_args, bs, max_q)
        for max_q in range(1, budget + 1)
        for bs in range(1, min(max_rows, budget - max_q + 1) + 1)
    }
    ladder = {_launch_class(plan_args, *batch) for batch in prompt_ladder(max_rows, budget, 4096)}
    assert ladder == reachable
    # Tiles of 16, 32 and 64 (query, head) pairs, with and without split KV (short tiles of
    # few rows always split), and the tiles of 64 with one a row (two pipeline stages) or
    # more (Triton's own).
    assert len(reachable) == classes


def test_the_ladder_runs_as_the_batches_it_names(llama_dir: str, tmp_path: Path) -> None:
    """Each ladder batch is one EXTEND of its rows (``rows - 1 + longest`` tokens: no prompt
    served from the prefix cache), and the engine serves the same tokens after it."""
    engine = engine_for(llama_dir, max_running=4, chunked_prefill_tokens=64)
    prompts = [[5, 6, 7, 8, 9] * 4, [11, 12, 13]]
    before = run(engine, [request(i, p, max_new_tokens=6) for i, p in enumerate(prompts)])
    log = tmp_path / "steps.jsonl"
    engine.loop.step_log = StepLog.open(str(log))
    warm_up(engine.loop, ladder=True)
    engine.loop.step_log.close()
    engine.loop.step_log = None
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    extends = [(s["rows"], s["tokens"]) for s in steps if s.get("kind") == "extend"]
    ladder = prompt_ladder(4, 64, engine.facts.context_length - 1)
    assert extends[1:] == [(rows, rows - 1 + longest) for rows, longest in ladder]
    assert not [s for s in steps if s.get("kind") == "decode" and s["tokens"] > 2]
    after = run(engine, [request(10 + i, p, max_new_tokens=6) for i, p in enumerate(prompts)])
    assert [o.token_ids for o in after.values()] == [o.token_ids for o in before.values()]


# The workload the GPU check serves after the warm-up, in a process of its own (so that no
# kernel compiled by an earlier test counts as warmed up): a long prompt, prompts served from
# its prefix, short prompts together, sampled rows with logprobs, arrivals staggered so that
# decode batches of every size run.
def _serve_and_report_compiles(model: str, settings: dict[str, object]) -> None:
    import triton

    compiled: list[str] = []

    def hook(*, repr: str, **_: object) -> None:  # called before each compile in this process
        compiled.append(repr)

    engine = engine_for(model, device="cuda", dtype="bfloat16", attention_backend="triton",
                        max_running=8, chunked_prefill_tokens=256, **settings)  # fmt: skip
    triton.knobs.runtime.jit_cache_hook = hook
    long = [3 + i % 290 for i in range(200)]

    def sampled(rid: int, prompt: list[int]) -> TokenizedRequest:
        return request(rid, prompt, max_new_tokens=9, temperature=0.8, top_p=0.9, seed=rid,
                       logprobs=2)  # fmt: skip

    batches = [
        [request(0, long, max_new_tokens=4)],
        [request(1 + i, long[:160] + [7 + i] * (9 + i), max_new_tokens=4) for i in range(8)],
        [request(20 + i, [30 + i, 31, 32], max_new_tokens=6) for i in range(8)],
        [sampled(40 + i, [50 + i] * (5 + 3 * i)) for i in range(8)],
    ]
    for i, batch in enumerate(batches):
        run(engine, batch, stagger=2 if i == 3 else 0)
    triton.knobs.runtime.jit_cache_hook = None
    print(json.dumps(compiled))


@pytest.mark.gpu
@pytest.mark.parametrize("algorithm", ENGINE_ALGORITHMS)
def test_no_kernel_compiles_while_serving(speculative_dirs: dict[str, str], algorithm: str) -> None:
    settings = dict(ENGINE_ALGORITHMS[algorithm])
    name = settings["speculative_algorithm"]
    if name in speculative_dirs:
        settings["draft_model"] = speculative_dirs[str(name)]
    tests = Path(__file__).parent
    code = (
        f"import sys; sys.path.insert(0, {str(tests)!r}); import test_warm_up; "
        f"test_warm_up._serve_and_report_compiles({speculative_dirs['target']!r}, {settings!r})"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    compiled = json.loads(done.stdout.strip().splitlines()[-1])
    assert compiled == [], "\n".join(compiled)


@pytest.mark.parametrize("algorithm", ["none", *DRAFT_ALGORITHMS])
def test_the_ladder_serves_under_every_algorithm(
    speculative_dirs: dict[str, str], algorithm: str
) -> None:
    """Each drafting algorithm's engine (its draft's prefill over every ladder batch) serves
    the ladder, and greedy outputs after it are those of an engine that never ran it."""
    settings = dict(DRAFT_ALGORITHMS.get(algorithm, {}))
    name = str(settings.get("speculative_algorithm", ""))
    if name in speculative_dirs:
        settings["draft_model"] = speculative_dirs[name]
    prompts = [[5 + i, 6, 7, 8, 9] * (1 + i % 5) for i in range(12)]

    def served(ladder: bool) -> list[list[int]]:
        engine = engine_for(speculative_dirs["target"], max_running=16, **settings)
        if ladder:
            warm_up(engine.loop, ladder=True)
        requests = [request(i, p, max_new_tokens=10) for i, p in enumerate(prompts)]
        return [o.token_ids for o in run(engine, requests).values()]

    assert served(ladder=True) == served(ladder=False)
