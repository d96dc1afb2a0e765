"""Acceptance length and tokens/s of the embedded model family through the real daemon.

Starts ``outrider serve`` (no ``--model``: the embedded family, unless the extra flags say
otherwise), sends the family's held-out prompts at ``--temperature`` (default 0; request ``i``
seeded ``i``), ``--new-tokens`` each (``ignore_eos``), once as raw ``prompt=`` text and once as
``messages=``, at most ``--concurrency`` at a time, and reports per form the mean acceptance
length from ``server_info()`` (``1 + accepted / drafts``), decode tokens/s and a digest of the
outputs (equal digests: equal outputs token for token).

    python benchmarks/family_acceptance.py --device cuda --concurrency 1 -- \\
        --speculative-algorithm eagle3 --speculative-num-steps 3

With ``--runs R`` the set is sent R times to the same daemon and tok/s is the median. The
report gives the seconds from the daemon's launch to READY (``ready_s``: the drafting policy's
start-up timing is part of it); the daemon logs at ``--daemon-log-level`` (default info: the
break-even it measured and a line per finished request).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from decode import wait_ready  # benchmarks/ is sys.path[0] when run as a script

from outrider.daemon.family import embedded_family
from outrider.protocol import AsyncClient

PROMPTS_FILE = "heldout_prompts.jsonl"


@dataclass
class FormResult:
    form: str  # "prompt" or "messages"
    temperature: float
    requests: int
    new_tokens: int
    tau: float  # 1 + accepted / drafts (1.0 without speculation)
    spec_drafts: int
    accepted_per_position: list[int]
    tokens_per_s: float  # the median over the runs
    runs_tokens_per_s: list[float]
    outputs_sha256: str


def load_prompts(count: int) -> list[list[dict[str, str]]]:
    """The first ``count`` held-out conversations' opening user turns, as messages."""
    family = embedded_family()
    if family is None:
        raise SystemExit("the outrider-family package is not installed (pip install ./family)")
    lines = (family.target.parent / PROMPTS_FILE).read_text().splitlines()
    return [json.loads(line)["messages"] for line in lines[:count]]


@dataclass(frozen=True)
class Workload:
    prompts: list[list[dict[str, str]]]
    new_tokens: int
    concurrency: int
    temperature: float
    runs: int


async def run_form(endpoint: str, form: str, work: Workload) -> FormResult:
    prompts = work.prompts
    gate = asyncio.Semaphore(work.concurrency)
    outputs: list[list[int]] = [[] for _ in prompts]

    async with AsyncClient(endpoint) as client:

        async def one(index: int, messages: list[dict[str, str]]) -> None:
            kwargs: dict[str, object] = (
                {"messages": messages} if form == "messages" else {"prompt": messages[0]["content"]}
            )
            async with gate:
                result = await client.generate(
                    **kwargs,  # type: ignore[arg-type]
                    max_new_tokens=work.new_tokens,
                    temperature=work.temperature,
                    seed=index,
                    ignore_eos=True,
                )
            outputs[index] = result.output_ids

        before = await client.server_info()
        rates = []
        for _ in range(work.runs):
            start = time.perf_counter()
            await asyncio.gather(*(one(i, m) for i, m in enumerate(prompts)))
            rates.append(sum(len(o) for o in outputs) / (time.perf_counter() - start))
        after = await client.server_info()
    drafts = after.spec_drafts - before.spec_drafts
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    per_position = [
        a - b
        for a, b in zip(
            after.spec_accepted_per_position, before.spec_accepted_per_position, strict=True
        )
    ]
    digest = hashlib.sha256(json.dumps(outputs).encode()).hexdigest()
    return FormResult(
        form=form,
        temperature=work.temperature,
        requests=len(prompts),
        new_tokens=work.new_tokens,
        tau=1 + accepted / drafts if drafts else 1.0,
        spec_drafts=drafts,
        accepted_per_position=per_position,
        tokens_per_s=statistics.median(rates),
        runs_tokens_per_s=[round(r, 2) for r in rates],
        outputs_sha256=digest,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompts", type=int, default=100)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=100)
    parser.add_argument("--forms", nargs="+", default=["prompt", "messages"])
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--daemon-log-level", default="info")
    parser.add_argument("serve_args", nargs="*", help="extra `outrider serve` flags (after --)")
    args = parser.parse_args()

    prompts = load_prompts(args.prompts)
    endpoint = f"ipc://{tempfile.mkdtemp()}/family.sock"
    command = [
        sys.executable, "-m", "outrider.daemon.cli", "serve", "--device", args.device,
        "--listen", endpoint, "--max-running", str(min(args.concurrency, 64)),
        "--log-level", args.daemon_log_level,
        *args.serve_args,
    ]  # fmt: skip
    print("daemon:", " ".join(command), flush=True)
    launched = time.perf_counter()
    proc = subprocess.Popen(command)
    results = []
    try:
        wait_ready(endpoint, proc, 600)
        ready_s = time.perf_counter() - launched
        print(f"ready in {ready_s:.1f} s", flush=True)
        for form in args.forms:
            work = Workload(prompts, args.new_tokens, args.concurrency, args.temperature, args.runs)
            result = asyncio.run(run_form(endpoint, form, work))
            results.append(result)
            print(json.dumps(asdict(result)), flush=True)
    finally:
        proc.terminate()
        proc.wait(120)
    report = {
        "command": command,
        "concurrency": args.concurrency,
        "ready_s": round(ready_s, 2),
        "results": [asdict(r) for r in results],
    }
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
