"""The embedded family at temperature 1 with its default DFlash draft, in process (float32 on
CPU): sampled requests draw coupled drafts from the draft's own distribution, so acceptance
rises above what argmax drafts reached (1 + accepted / drafts = 1.307 on these 24 prompts, 64
tokens each, request i seeded i; coupled drafts measured 1.417), and the seeded outputs stay
the target-only ones token for token."""

from __future__ import annotations

import json

import pytest
from engine_harness import engine_for, request, run, tau_of, tokens_of
from transformers import AutoTokenizer

from outrider.daemon.family import embedded_family

PROMPTS = 24
NEW_TOKENS = 64
ARGMAX_TAU = 1.307  # the same requests with {"sample": "argmax"}
MIN_TAU = 1.37


def test_dflash_sampled_drafts_beat_argmax_drafts_at_temperature_1() -> None:
    family = embedded_family()
    if family is None:
        pytest.fail("the outrider-family package is not installed: pip install ./family")
    tokenizer = AutoTokenizer.from_pretrained(family.target)
    lines = (family.target.parent / "heldout_prompts.jsonl").read_text().splitlines()
    template = tokenizer.apply_chat_template
    prompts = [
        list(template(json.loads(line)["messages"], add_generation_prompt=True)["input_ids"])
        for line in lines[:PROMPTS]
    ]
    reqs = [
        request(i, p, max_new_tokens=NEW_TOKENS, temperature=1.0, seed=i)
        for i, p in enumerate(prompts)
    ]
    plain = tokens_of(run(engine_for(str(family.target)), reqs))
    engine = engine_for(
        str(family.target), speculative_algorithm="dflash", draft_model=str(family.drafts["dflash"])
    )
    assert tokens_of(run(engine, reqs)) == plain
    assert tau_of(engine.scheduler.counters()) >= MIN_TAU > ARGMAX_TAU
