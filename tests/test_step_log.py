"""The step log (``--step-log``, scheduler/step_log.py) of an in-process engine: a line per
loop turn, in order, each launched step's plan as launched, timings that add up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from engine_harness import engine_for, record_launches, request, run
from model_fixtures import VOCAB


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
def test_a_line_per_turn_with_its_step_as_launched(
    llama_dir: str, tmp_path: Path, overlap: bool
) -> None:
    path = tmp_path / "steps.jsonl"
    path.write_text("earlier\n")  # the log appends
    engine = engine_for(
        llama_dir, step_log=str(path), mixed_batches=True, chunked_prefill_tokens=24,
        page_size=4, max_running=3, no_overlap=not overlap,
    )  # fmt: skip
    loop = engine.loop
    launched = record_launches(loop.runner)
    turns = 0
    iterate = loop.iterate

    def counted() -> object:
        nonlocal turns
        turns += 1
        return iterate()

    loop.iterate = counted  # type: ignore[method-assign]
    prompts = [[3 + (5 * i + j) % (VOCAB - 3) for j in range(10 + 7 * i)] for i in range(6)]
    samplings = [{}, {"temperature": 0.8}, {"temperature": 0.8, "top_p": 0.9}]
    requests = [
        request(i, p, max_new_tokens=8, seed=i, **samplings[i % 3])  # type: ignore[arg-type]
        for i, p in enumerate(prompts)
    ]
    run(engine, requests, stagger=2)
    loop.close()
    first, *lines = path.read_text().splitlines()
    assert first == "earlier" and len(lines) == turns
    entries = [json.loads(line) for line in lines]
    steps = [e for e in entries if "kind" in e]
    kinds = {(True, True): "greedy", (True, False): "greedy", (False, True): "cut"}
    assert [
        (s["kind"], s["rows"], s["tokens"], s["width"], s["riders"], s["unfed"], s["sampling"])
        for s in steps
    ] == [
        (
            p.kind, p.bs, p.num_tokens, p.q_lens[0] if p.kind == "decode" else 0,
            len(p.relay_rows), len(p.unfed), kinds.get((p.all_greedy, p.cuts), "sampled"),
        )
        for p in launched
    ]  # fmt: skip
    assert {s["sampling"] for s in steps} == {"greedy", "sampled", "cut"}
    assert any(s["riders"] for s in steps) and any(s["kind"] == "decode" for s in steps)
    # Under overlap the last turn only processes the step before it: no step of its own.
    assert (len(steps) < len(entries)) == overlap
    times = [e["t"] for e in entries]
    assert times == sorted(times)
    for e in entries:
        assert 0 <= e["plan_ms"] <= e["turn_ms"] and 0 <= e["wait_ms"] <= e["turn_ms"], e
    assert all(s["waiting"] >= 0 for s in steps) and any(s["waiting"] for s in steps)
