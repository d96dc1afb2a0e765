"""Acceptance under a JSON schema: the embedded family's trained drafts, in process, greedy.

For each algorithm, the family's held-out prompts (their opening user turns through the chat
template, each asked to answer in JSON) decode three ways: without a grammar (``--new-tokens``
each, ``ignore_eos``), under the schema with the drafts proposed under it (the default), and
under the schema with the guide switched off (drafts proposed freely; the verify alone
masks). Reports the mean acceptance length (``1 + accepted / drafts``) of each. Tokens under
the schema are the same both ways (the verify masks every node): only acceptance differs.

``--dflash-guided K ...`` measures DFlash alone under the schema with only the first ``K``
places of each block guided (the rest drafted freely in one go, as unconstrained): what each
guided place, a wait for the host's mask inside the step, buys in acceptance.

``--chain-guided K ...`` measures the EAGLE-3 chain (``--chain-steps`` drafts) alone under
the schema with only its first ``K`` draft places guided (the later ones drafted from the
draft's own logits), as ``--dflash-guided`` does for DFlash.

``--dflash-walk R ...`` serves the prompts ``R`` at a time with DFlash under the schema, with
each place's best ids handed to the guide (the host chooses the places whose masked argmax is
among them, ``GrammarGuide``) and without: acceptance, tokens, and the guide's waits for the
device per guided step of each.

    python benchmarks/grammar_acceptance.py [--prompts 16] [--device cpu] [--dflash-guided 1 2 4]
        [--dflash-walk 1 4 8] [--chain-guided 0 1 2 3 --chain-steps 3]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any
from unittest import mock

import msgspec
import torch
from host_turn import family_settings  # benchmarks/ is sys.path[0] when run as a script
from transformers import AutoTokenizer

from outrider.daemon.config import ServeConfig
from outrider.daemon.engine import host_masks
from outrider.daemon.engine.build import build_engine
from outrider.daemon.engine.host_masks import GrammarGuide
from outrider.daemon.engine.token_masks import TokenMasks
from outrider.daemon.grammar.compiler import Grammars
from outrider.daemon.internal import own_request
from outrider.plugins.speculative.base import DecodeView, Drafts
from outrider.plugins.speculative.dflash_impl import DFlashWorker
from outrider.protocol.messages import Grammar

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = ROOT / "benchmarks" / "structured" / "review.schema.json"
ASK = " Answer in JSON: a short review of this request."


def acceptance(
    settings: dict[str, object],
    prompts: list[list[int]],
    grammar: Grammar | None,
    grammars: Grammars,
    new_tokens: int,
    rows: int = 0,
) -> tuple[float, int]:
    """The mean acceptance length of ``prompts`` served ``rows`` at a time (0: together) in
    process (every decode batch drafting), and the tokens they produced."""
    running = rows or len(prompts)
    config = ServeConfig(**settings, max_running=running, speculative_min_acceptance=0.0)  # type: ignore[arg-type]  # family_settings' types
    loop = build_engine(config).loop
    for rid, prompt in enumerate(prompts):
        req = own_request(rid, f"r{rid}", prompt, new_tokens)
        if grammar is not None:
            req = msgspec.structs.replace(req, grammar=grammar, ignore_eos=False)
        loop.scheduler.add(req, None if grammar is None else grammars.start(req))
    drafts = accepted = tokens = 0
    while loop.has_work:
        for update in loop.iterate():
            tokens += len(update.token_ids)
            if update.finish is not None:
                drafts += update.finish.usage.spec_drafts
                accepted += update.finish.usage.spec_accepted_tokens
    return 1 + accepted / max(drafts, 1), tokens


def first_places_guided(places: int) -> Any:
    """``GrammarGuide.restrict`` for the first ``places`` draft places only (a place's
    path holds the drafts before it)."""
    restrict = GrammarGuide.restrict

    def first_only(
        guide: GrammarGuide,
        logits: torch.Tensor,
        paths: torch.Tensor,
        columns: torch.Tensor | None = None,
    ) -> None:
        if paths.shape[1] < places:
            restrict(guide, logits, paths, columns)

    return first_only


def walk_waits(
    settings: dict[str, object],
    prompts: list[list[int]],
    grammar: Grammar,
    grammars: Grammars,
    new_tokens: int,
    rows: int,
    walk: bool,
) -> dict[str, object]:
    """DFlash under ``grammar``, ``rows`` prompts at a time, with the places' best ids handed
    to the guide (``walk``) or not: acceptance, tokens, and waits for the device a guided
    step (a step whose worker drafted under the guide)."""
    waits = steps = 0
    guided = DFlashWorker._guided

    def counted_wait(masks: TokenMasks) -> None:
        nonlocal waits
        waits += 1

    def counted_step(worker: DFlashWorker, view: DecodeView, local: torch.Tensor) -> Drafts:
        nonlocal steps
        steps += 1
        return guided(worker, view, local)

    count = GrammarGuide.candidate_count if walk else (lambda guide, bs: 0)
    with (
        mock.patch.object(TokenMasks, "wait_for_device", counted_wait),
        mock.patch.object(DFlashWorker, "_guided", counted_step),
        mock.patch.object(GrammarGuide, "candidate_count", count),
    ):
        tau, tokens = acceptance(settings, prompts, grammar, grammars, new_tokens, rows)
    return {"algorithm": "dflash", "rows": rows, "chosen_on_host": walk,
            "tau_schema": round(tau, 3), "tokens_schema": tokens, "guided_steps": steps,
            "waits_a_step": round(waits / max(steps, 1), 3)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dflash-guided", type=int, nargs="+", help="guided places (above)")
    parser.add_argument("--dflash-walk", type=int, nargs="+", help="rows at a time (above)")
    parser.add_argument("--chain-guided", type=int, nargs="+", help="guided places (above)")
    parser.add_argument("--chain-steps", type=int, default=3, help="the chain's drafts")
    args = parser.parse_args()
    target = str(family_settings(args.device, "none")["model"])
    hf = AutoTokenizer.from_pretrained(target)
    lines = (Path(target).parent / "heldout_prompts.jsonl").read_text().splitlines()
    texts = [
        hf.apply_chat_template(
            [{"role": "user", "content": json.loads(line)["messages"][0]["content"] + ASK}],
            add_generation_prompt=True,
            tokenize=False,
        )
        for line in lines[: args.prompts]
    ]
    prompts = [hf.encode(text, add_special_tokens=False) for text in texts]
    grammars = Grammars(target, hf.vocab_size, [hf.eos_token_id])
    schema = Grammar("json_schema", SCHEMA.read_text())
    shapes: dict[str, tuple[str, dict[str, object]]] = {
        "ngram": ("ngram", {}),
        "eagle3 chain": ("eagle3", {"speculative_num_steps": 3}),
        "eagle3 tree": ("eagle3", {"speculative_num_steps": 3, "speculative_topk": 4,
                                   "speculative_num_draft_tokens": 8}),
        "dflash": ("dflash", {}),
    }  # fmt: skip
    if args.chain_guided:
        shape = {"speculative_num_steps": args.chain_steps}
        settings = family_settings(args.device, "eagle3") | shape
        for places in args.chain_guided:
            with mock.patch.object(GrammarGuide, "restrict", first_places_guided(places)):
                tau, tokens = acceptance(settings, prompts, schema, grammars, args.new_tokens)
            row = {"algorithm": "eagle3 chain", "steps": args.chain_steps,
                   "guided_places": places, "tau_schema": round(tau, 3),
                   "tokens_schema": tokens}  # fmt: skip
            print(json.dumps(row), flush=True)
        return
    if args.dflash_walk:
        settings = family_settings(args.device, "dflash")
        for rows in args.dflash_walk:
            for walk in (True, False):
                row = walk_waits(settings, prompts, schema, grammars, args.new_tokens, rows, walk)
                print(json.dumps(row), flush=True)
        return
    if args.dflash_guided:
        settings = family_settings(args.device, "dflash")
        for places in args.dflash_guided:
            with mock.patch.object(host_masks, "BLOCK_GUIDED_PLACES", (places, places)):
                tau, tokens = acceptance(settings, prompts, schema, grammars, args.new_tokens)
            row = {"algorithm": "dflash", "guided_places": places,
                   "tau_schema": round(tau, 3), "tokens_schema": tokens}  # fmt: skip
            print(json.dumps(row), flush=True)
        return
    for name, (algorithm, shape) in shapes.items():
        settings = family_settings(args.device, algorithm) | shape
        plain = acceptance(settings, prompts, None, grammars, args.new_tokens)
        guided = acceptance(settings, prompts, schema, grammars, args.new_tokens)
        with mock.patch.object(GrammarGuide, "restrict", lambda *a, **k: None):
            free = acceptance(settings, prompts, schema, grammars, args.new_tokens)
        print(json.dumps({
            "algorithm": name, "prompts": len(prompts),
            "tau_plain": round(plain[0], 3), "tau_schema_guided": round(guided[0], 3),
            "tau_schema_unguided": round(free[0], 3),
            "tokens_plain": plain[1], "tokens_schema": guided[1],
        }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
