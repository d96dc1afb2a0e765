"""The embedded model family (``pip install ./family``) in process, float32 on CPU: on the first
32 of its 100 held-out prompts, 128 new tokens each, sent through the chat template as
``messages=`` does, every draft's greedy output equals the target alone token for token, and
the mean acceptance length stays above floors a little under the figures measured on them
(2.688, 2.343 and 3.053; greedy on CPU, so the same every run). The whole 100 (MODEL_CARD.md:
2.827, 2.451 and 3.316) and raw ``prompt=`` text are measured by
``benchmarks/family_acceptance.py``; they are left out here to keep the suite short (the whole
100 in both forms take about 3.5 min on 2 cores, these 32 about 1.3 min)."""

from __future__ import annotations

import json

import pytest
from engine_harness import engine_for, requests_for, run, tau_of, tokens_of
from transformers import AutoTokenizer

from outrider.daemon.family import Family, embedded_family
from outrider.daemon.internal import TokenizedRequest

NEW_TOKENS = 128
PROMPTS = 32  # the first of the held-out prompts
# (flags, floor on 1 + accepted / drafts)
CONFIGS: dict[str, tuple[dict[str, object], float]] = {
    "dflash": ({"speculative_algorithm": "dflash"}, 2.66),
    "eagle3-chain": ({"speculative_algorithm": "eagle3", "speculative_num_steps": 3}, 2.32),
    "eagle3-tree": (
        {
            "speculative_algorithm": "eagle3",
            "speculative_num_steps": 5,
            "speculative_topk": 4,
            "speculative_num_draft_tokens": 16,
        },
        3.02,
    ),
}


@pytest.fixture(scope="module")
def family() -> Family:
    found = embedded_family()
    if found is None:
        pytest.fail("the outrider-family package is not installed: pip install ./family")
    return found


@pytest.fixture(scope="module")
def requests(family: Family) -> list[TokenizedRequest]:
    """The first ``PROMPTS`` held-out prompts as the front door encodes ``messages=`` (the chat
    template with the generation prompt)."""
    tokenizer = AutoTokenizer.from_pretrained(family.target)
    lines = (family.target.parent / "heldout_prompts.jsonl").read_text().splitlines()
    conversations = [json.loads(line)["messages"] for line in lines]
    assert len(conversations) == 100
    template = tokenizer.apply_chat_template
    ids = [
        list(template(m, add_generation_prompt=True, tokenize=True)["input_ids"])
        for m in conversations[:PROMPTS]
    ]
    return requests_for(ids, max_new_tokens=NEW_TOKENS)


@pytest.fixture(scope="module")
def plain(family: Family, requests: list[TokenizedRequest]) -> dict[int, list[int]]:
    return tokens_of(run(engine_for(str(family.target)), requests))


@pytest.mark.parametrize("name", CONFIGS)
def test_drafts_are_lossless_and_accepted(
    family: Family,
    requests: list[TokenizedRequest],
    plain: dict[int, list[int]],
    name: str,
) -> None:
    flags, floor = CONFIGS[name]
    algorithm = str(flags["speculative_algorithm"])
    engine = engine_for(str(family.target), draft_model=str(family.drafts[algorithm]), **flags)
    assert tokens_of(run(engine, requests)) == plain
    counters = engine.scheduler.counters()
    assert tau_of(counters) >= floor, (name, tau_of(counters), counters.spec_accepted_per_position)
