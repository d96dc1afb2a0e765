"""Acceptance under a JSON schema: the embedded family's trained drafts, in process, greedy.

For each algorithm, the family's held-out prompts (their opening user turns through the chat
template, each asked to answer in JSON) decode three ways: without a grammar (``--new-tokens``
each, ``ignore_eos``), under the schema with the drafts proposed under it (the default), and
under the schema with the guide switched off (drafts proposed freely; the verify alone
masks). Reports the mean acceptance length (``1 + accepted / drafts``) of each. Tokens under
the schema are the same both ways (the verify masks every node): only acceptance differs.

    python benchmarks/grammar_acceptance.py [--prompts 16] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the in-process engine's harness

from engine_harness import engine_for, request, run  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from outrider.daemon.engine.token_masks import GrammarGuide  # noqa: E402
from outrider.daemon.family import embedded_family  # noqa: E402
from outrider.daemon.grammar.compiler import Grammars  # noqa: E402
from outrider.protocol.messages import Grammar  # noqa: E402

SCHEMA = ROOT / "benchmarks" / "structured" / "review.schema.json"
ASK = " Answer in JSON: a short review of this request."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    family = embedded_family()
    if family is None:
        raise SystemExit("the outrider-family package is not installed (pip install ./family)")
    target, folder = str(family.target), family.target.parent
    hf = AutoTokenizer.from_pretrained(target)
    lines = (folder / "heldout_prompts.jsonl").read_text().splitlines()[: args.prompts]
    texts = [
        hf.apply_chat_template(
            [{"role": "user", "content": json.loads(line)["messages"][0]["content"] + ASK}],
            add_generation_prompt=True,
            tokenize=False,
        )
        for line in lines
    ]
    prompts = [hf.encode(text, add_special_tokens=False) for text in texts]
    grammars = Grammars(target, hf.vocab_size, [hf.eos_token_id])
    schema = Grammar("json_schema", SCHEMA.read_text())
    algorithms = {
        "ngram": {"speculative_algorithm": "ngram"},
        "eagle3 chain": {"speculative_algorithm": "eagle3", "draft_model": str(folder / "eagle3"),
                         "speculative_num_steps": 3},
        "eagle3 tree": {"speculative_algorithm": "eagle3", "draft_model": str(folder / "eagle3"),
                        "speculative_num_steps": 3, "speculative_topk": 4,
                        "speculative_num_draft_tokens": 8},
        "dflash": {"speculative_algorithm": "dflash", "draft_model": str(folder / "dflash")},
    }  # fmt: skip

    def tau(settings: dict[str, object], grammar: Grammar | None) -> tuple[float, int]:
        engine = engine_for(target, device=args.device, max_running=len(prompts), **settings)
        reqs = [
            request(i, ids, max_new_tokens=args.new_tokens, ignore_eos=grammar is None,
                    grammar=grammar)
            for i, ids in enumerate(prompts)
        ]  # fmt: skip
        outcomes = run(engine, reqs, grammars=grammars)
        drafts = sum(o.finish.usage.spec_drafts for o in outcomes.values())
        accepted = sum(o.finish.usage.spec_accepted_tokens for o in outcomes.values())
        tokens = sum(len(o.token_ids) for o in outcomes.values())
        return 1 + accepted / max(drafts, 1), tokens

    for name, settings in algorithms.items():
        plain = tau(settings, None)
        guided = tau(settings, schema)
        with mock.patch.object(GrammarGuide, "restrict", lambda *a, **k: None):
            free = tau(settings, schema)
        print(json.dumps({
            "algorithm": name, "prompts": len(prompts),
            "tau_plain": round(plain[0], 3), "tau_schema_guided": round(guided[0], 3),
            "tau_schema_unguided": round(free[0], 3),
            "tokens_plain": plain[1], "tokens_schema": guided[1],
        }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
