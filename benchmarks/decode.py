"""Decode throughput through the real daemon, next to the memory-bandwidth roofline.

Starts ``outrider serve`` on the given model (``--load-format dummy`` for a config.json),
sends batches of concurrent streamed requests with ``ignore_eos`` from the client side, and
reports decode tokens/s = tokens after each request's first / (last chunk - first chunk of the
batch), beside the roofline: bytes read per step (every weight except the input-embedding
table, plus the batch's KV) divided by the read bandwidth measured on the spot.

    python benchmarks/decode.py --model Qwen3-8B.config.json --device cuda --batch 1 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from outrider.daemon.bench.roofline import read_bandwidth, weight_bytes
from outrider.plugins.models.config import ModelConfig, kv_bytes_per_token
from outrider.protocol import AsyncClient, Client, Timeout


@dataclass
class Row:
    batch: int
    new_tokens: int
    prompt_tokens: int
    decode_tok_s: float
    step_ms: float
    roofline_tok_s: float
    percent_of_roofline: float


async def run_batch(
    endpoint: str, batch: int, prompt_tokens: int, new_tokens: int, vocab: int
) -> tuple[float, int]:
    """Returns (decode seconds, decode tokens) of one batch sent at once."""
    rng = random.Random(batch)
    firsts: list[float] = []
    lasts: list[float] = []

    async def one(client: AsyncClient) -> int:
        ids = [rng.randrange(100, vocab) for _ in range(prompt_tokens)]
        stream = client.stream(
            input_ids=ids, max_new_tokens=new_tokens, ignore_eos=True, temperature=0.0
        )
        count = 0
        first = last = 0.0
        async for chunk in stream:
            now = time.perf_counter()
            if count == 0:
                first = now
            count += len(chunk.token_ids)
            last = now
        firsts.append(first)
        lasts.append(last)
        return count

    async with AsyncClient(endpoint) as client:
        counts = await asyncio.gather(*(one(client) for _ in range(batch)))
    assert all(c == new_tokens for c in counts), counts
    return max(lasts) - max(firsts), batch * (new_tokens - 1)


def wait_ready(endpoint: str, proc: subprocess.Popen[bytes], limit: float) -> None:
    deadline = time.monotonic() + limit
    with Client(endpoint) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"the daemon exited with code {proc.returncode}")
            try:
                if client.health(timeout=2.0).status == "serving":
                    return
            except Timeout:
                continue
    raise SystemExit("the daemon did not become ready")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path)
    parser.add_argument("serve_args", nargs="*", help="extra `outrider serve` flags (after --)")
    args = parser.parse_args()

    config = ModelConfig.from_pretrained(args.model)
    bandwidth = read_bandwidth(args.device)
    weights = weight_bytes(config, args.dtype)
    per_token_kv = kv_bytes_per_token(config, args.dtype)
    endpoint = f"ipc://{tempfile.mkdtemp()}/bench.sock"
    load_format = "dummy" if args.model.endswith(".json") else "auto"
    command = [
        sys.executable, "-m", "outrider.daemon.cli", "serve", "--model", args.model,
        "--load-format", load_format, "--device", args.device, "--dtype", args.dtype,
        "--listen", endpoint, "--max-running", str(max(args.batch)),
        "--context-length", str(args.prompt_tokens + args.new_tokens + 64),
        *args.serve_args,
    ]  # fmt: skip
    print("daemon:", " ".join(command), flush=True)
    proc = subprocess.Popen(command, env={**os.environ, "OUTRIDER_LOG_LEVEL": "warning"})
    rows: list[Row] = []
    try:
        wait_ready(endpoint, proc, 900)
        asyncio.run(run_batch(endpoint, 1, args.prompt_tokens, 8, config.vocab_size))  # warm
        for batch in args.batch:
            seconds, tokens = asyncio.run(
                run_batch(endpoint, batch, args.prompt_tokens, args.new_tokens, config.vocab_size)
            )
            steps = args.new_tokens - 1
            mean_context = args.prompt_tokens + args.new_tokens / 2
            step_bytes = weights + batch * mean_context * per_token_kv
            roofline = batch * bandwidth / step_bytes
            rate = tokens / seconds
            step_ms = 1000 * seconds / steps
            percent = 100 * rate / roofline
            rows.append(
                Row(batch, args.new_tokens, args.prompt_tokens, rate, step_ms, roofline, percent)
            )
    finally:
        proc.terminate()
        proc.wait(120)
    report = {
        "model": args.model,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "read_bandwidth_tb_s": bandwidth / 1e12,
        "weight_gb_per_step": weights / 1e9,
        "kv_kib_per_token": per_token_kv / 1024,
        "rows": [asdict(r) for r in rows],
    }
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
