"""Sampling defaults for the embedded family, chosen by measurement: coherence, degeneration and
DFlash acceptance over a grid of temperature x top_p x top_k, in process on CPU (float32).

Every setting serves the family's held-out prompts through the chat template, ``--new-tokens``
each (``ignore_eos``), request ``i`` seeded ``i``, on one engine with the DFlash draft drafting
every step (``speculative_min_acceptance`` 0; its seeded outputs are the target's own, token for
token). Per setting:

- ``nll``: coherence, the target's mean negative log-likelihood per token of its own output at
  temperature 1 with no truncation (the full distribution), pooled over all outputs;
- ``loops``: degeneration, the share of outputs in which the tokens covered by 4-grams that
  occur at least twice exceed 30 %; ``distinct2``: distinct bigrams over bigrams, the mean over
  the outputs;
- ``tau``: DFlash's mean acceptance length, 1 + accepted / drafts, over all ``--new-tokens``.

``nll``, ``loops`` and ``distinct2`` read each output up to its first EOS, EOS included (what a
request that does not ignore EOS returns); ``length`` is the mean of those lengths. At
temperature 0 top_p and top_k do nothing, so the grid holds one greedy row.

The rule, fixed before the first measurement (``choose``):

1. Degeneration: a setting qualifies when ``loops`` <= 5 % and ``distinct2`` >= 0.9 times that
   of pure sampling (temperature 1, top_p 1, top_k 0: the model's own distribution).
2. Coherence: among the qualified, those within a tenth of the greedy-to-pure-sampling ``nll``
   span of the lowest qualified ``nll`` are near-ties.
3. Speed: among the near-ties, the highest ``tau``; then the lower ``nll``.
   (Nothing qualifies: the lowest ``loops``, then the lower ``nll``.)

    python benchmarks/family_generation.py --prompts 30 --out grid.json
    python benchmarks/family_generation.py --rows grid.json  # the table and the choice again

BENCHMARKS.md, "Sampling defaults of the embedded family", has the measured grid (split over
processes by temperature) and why the family ships what it does.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from outrider.daemon.config import ServeConfig
from outrider.daemon.engine.build import Engine, build_engine
from outrider.daemon.family import Family, embedded_family
from outrider.daemon.internal import TokenizedRequest
from outrider.plugins.sampling_spec import SamplingSpec

PROMPTS_FILE = "heldout_prompts.jsonl"
LOOP_NGRAM = 4
LOOP_COVERAGE = 0.30  # an output loops when repeated 4-grams cover more than this share
MAX_LOOPS = 0.05  # rule 1: at most this share of outputs loop
MIN_DISTINCT2_RATIO = 0.9  # rule 1: distinct-2 at least this times pure sampling's
NEAR_TIE_SPAN = 0.1  # rule 2: this share of the greedy-to-pure-sampling nll span


@dataclass(frozen=True)
class Setting:
    temperature: float
    top_p: float
    top_k: int


PURE_SAMPLING = Setting(1.0, 1.0, 0)
GREEDY = Setting(0.0, 1.0, 0)


@dataclass
class Row:
    temperature: float
    top_p: float
    top_k: int
    nll: float  # nats per token under the target at temperature 1
    loops: float  # share of outputs that loop
    distinct2: float
    length: float  # mean tokens up to the first EOS, EOS included
    tau: float  # DFlash: 1 + accepted / drafts
    seconds: float  # wall time of the setting (generation and scoring)

    @property
    def setting(self) -> Setting:
        return Setting(self.temperature, self.top_p, self.top_k)


def grid(
    temperatures: Sequence[float], top_ps: Sequence[float], top_ks: Sequence[int]
) -> list[Setting]:
    """Every combination; temperature 0 (greedy, which ignores top_p and top_k) once."""
    settings = [GREEDY] if 0.0 in temperatures else []
    sampled = [t for t in temperatures if t > 0.0]
    settings += [Setting(t, p, k) for t, p, k in itertools.product(sampled, top_ps, top_ks)]
    return settings


def load_prompts(family: Family, count: int) -> list[list[int]]:
    """The first ``count`` held-out prompts through the chat template with the generation prompt
    (what ``messages=`` sends)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(family.target)
    lines = (family.target.parent / PROMPTS_FILE).read_text().splitlines()[:count]
    prompts = []
    for line in lines:
        messages = json.loads(line)["messages"]
        # A BatchEncoding; transformers types the return as a union of every form.
        encoded: Any = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        prompts.append(list(encoded["input_ids"]))
    return prompts


def dflash_engine(family: Family, prompts: list[list[int]], new_tokens: int) -> Engine:
    longest = max(len(p) for p in prompts) + new_tokens
    config = ServeConfig(
        model=str(family.target),
        device="cpu",
        max_running=len(prompts),
        kv_cache_tokens=len(prompts) * (longest + 32),
        speculative_algorithm="dflash",
        draft_model=str(family.drafts["dflash"]),
        speculative_min_acceptance=0.0,  # draft every step: tau is the lever being measured
    )
    return build_engine(config)


def generate(
    engine: Engine, prompts: list[list[int]], setting: Setting, new_tokens: int, rid0: int
) -> tuple[list[list[int]], float]:
    """Each prompt's ``new_tokens`` tokens (request ``i`` seeded ``i``) and DFlash's tau."""
    before = engine.scheduler.counters()
    outputs: dict[int, list[int]] = {rid0 + i: [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        sampling = SamplingSpec(setting.temperature, setting.top_p, setting.top_k, seed=i)
        engine.scheduler.add(
            TokenizedRequest(
                rid=rid0 + i, request_id=f"g{rid0 + i}", input_ids=prompt, sampling=sampling,
                max_new_tokens=new_tokens, stop=[], stop_token_ids=[], ignore_eos=True,
                stream=False, want_logprobs=False, arrival=time.time(),
            )
        )  # fmt: skip
    while engine.loop.has_work:
        for update in engine.loop.iterate():
            if update.error is not None:
                raise RuntimeError(f"request {update.rid}: {update.error}")
            outputs[update.rid].extend(update.token_ids)
    after = engine.scheduler.counters()
    drafts = after.spec_drafts - before.spec_drafts
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    return [outputs[rid0 + i] for i in range(len(prompts))], 1 + accepted / max(drafts, 1)


def until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[: i + 1]
    return tokens


@torch.inference_mode()
def mean_nll(model: torch.nn.Module, prompts: list[list[int]], outputs: list[list[int]]) -> float:
    """Nats per output token under ``model`` at temperature 1, pooled over all outputs."""
    total, count = 0.0, 0
    for prompt, output in zip(prompts, outputs, strict=True):
        ids = torch.tensor([prompt + output])  # ids: [1, P + O]
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()  # [O, V]
        logp = torch.log_softmax(logits, dim=-1)
        total -= logp.gather(1, torch.tensor(output)[:, None]).sum().item()
        count += len(output)
    return total / count


def loops(tokens: list[int]) -> bool:
    """More than ``LOOP_COVERAGE`` of ``tokens`` lie in 4-grams that occur at least twice."""
    grams = [tuple(tokens[i : i + LOOP_NGRAM]) for i in range(len(tokens) - LOOP_NGRAM + 1)]
    counts = Counter(grams)
    covered: set[int] = set()
    for i, gram in enumerate(grams):
        if counts[gram] >= 2:
            covered.update(range(i, i + LOOP_NGRAM))
    return len(covered) > LOOP_COVERAGE * len(tokens)


def distinct2(tokens: list[int]) -> float:
    bigrams = list(itertools.pairwise(tokens))
    return len(set(bigrams)) / len(bigrams) if bigrams else 1.0


def choose(rows: list[Row]) -> Row:
    """The rule of the module docstring."""
    by_setting = {r.setting: r for r in rows}
    pure, greedy = by_setting[PURE_SAMPLING], by_setting[GREEDY]
    qualified = [
        r
        for r in rows
        if r.loops <= MAX_LOOPS and r.distinct2 >= MIN_DISTINCT2_RATIO * pure.distinct2
    ]
    if not qualified:
        return min(rows, key=lambda r: (r.loops, r.nll))
    best = min(r.nll for r in qualified)
    margin = NEAR_TIE_SPAN * (pure.nll - greedy.nll)
    near_ties = [r for r in qualified if r.nll <= best + margin]
    return max(near_ties, key=lambda r: (r.tau, -r.nll))


def markdown(rows: list[Row], chosen: Row) -> str:
    lines = [
        "| T | top_p | top_k | nll | loops | distinct-2 | length | DFlash tau |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in sorted(rows, key=lambda r: (r.temperature, r.top_p, r.top_k)):
        mark = "**" if r is chosen else ""
        lines.append(
            f"| {mark}{r.temperature:g}{mark} | {r.top_p:g} | {r.top_k} | {r.nll:.3f} | "
            f"{r.loops:.0%} | {r.distinct2:.3f} | {r.length:.1f} | {r.tau:.2f} |"
        )
    return "\n".join(lines)


def measure(args: argparse.Namespace, settings: list[Setting]) -> list[Row]:
    from transformers import AutoModelForCausalLM

    family = embedded_family()
    if family is None:
        raise SystemExit("the outrider-family package is not installed (pip install ./family)")
    prompts = load_prompts(family, args.prompts)
    engine = dflash_engine(family, prompts, args.new_tokens)
    target = AutoModelForCausalLM.from_pretrained(family.target, dtype=torch.float32).eval()
    eos = set(engine.facts.eos_token_ids)
    rows = []
    for n, setting in enumerate(settings):
        start = time.perf_counter()
        outputs, tau = generate(engine, prompts, setting, args.new_tokens, n * len(prompts))
        shown = [until_eos(o, eos) for o in outputs]
        row = Row(
            **asdict(setting),
            nll=round(mean_nll(target, prompts, shown), 4),
            loops=sum(map(loops, shown)) / len(shown),
            distinct2=round(sum(map(distinct2, shown)) / len(shown), 4),
            length=sum(map(len, shown)) / len(shown),
            tau=round(tau, 4),
            seconds=round(time.perf_counter() - start, 1),
        )
        print(json.dumps(asdict(row)), flush=True)
        rows.append(row)
    return rows


def report_rows(path: str) -> list[Row]:
    return [Row(**r) for r in json.loads(Path(path).read_text())["rows"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=100)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument(
        "--temperatures", type=float, nargs="+", default=[0.0, 0.3, 0.5, 0.7, 0.8, 1.0]
    )
    parser.add_argument("--top-p", type=float, nargs="+", default=[0.8, 0.9, 0.95, 1.0])
    parser.add_argument("--top-k", type=int, nargs="+", default=[0, 20, 50])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--out", help="write the rows and the versions as JSON")
    parser.add_argument(
        "--rows",
        nargs="+",
        metavar="JSON",
        help="no measuring: tabulate and choose from --out files",
    )
    args = parser.parse_args()
    print("command:", " ".join(sys.argv), flush=True)
    if args.rows:
        rows = [row for path in args.rows for row in report_rows(path)]
    else:
        torch.set_num_threads(args.threads)
        rows = measure(args, grid(args.temperatures, args.top_p, args.top_k))
        if args.out:
            Path(args.out).write_text(json.dumps(report(rows), indent=2) + "\n")
    if not {GREEDY, PURE_SAMPLING} <= {r.setting for r in rows}:
        print("no choice: the rule needs the greedy and the pure-sampling (1, 1, 0) rows")
        return
    chosen = choose(rows)
    print(markdown(rows, chosen))
    print("chosen:", json.dumps(asdict(chosen.setting)))


def report(rows: list[Row]) -> dict[str, object]:
    import transformers

    return {
        "command": sys.argv,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "threads": torch.get_num_threads(),
            "machine": platform.machine(),
        },
        "rows": [asdict(r) for r in rows],
    }


if __name__ == "__main__":
    main()
