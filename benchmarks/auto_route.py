"""Where ``auto``'s two decode backends cross (GPU only): each backend that reads its lengths on
the device, with its default options, over a grid of rows and contexts; one layer's decode
attention timed as ``triton_attention.py`` times it (a CUDA graph over L2-cold copies of the
batch's paged K/V, pages handed out shuffled), and the KV read rate it reaches.

    python benchmarks/auto_route.py [--backends triton fa4] [--rows 8 32 64 128 256] \\
        [--contexts 512 1024 2048 4096 8192] [--page-size 16]

``auto`` routes a batch by its rows alone (``large_from_batch``, ``small_from_batch``). After
the grid, each row count's crossover: the shortest context from which the second backend is
faster at every longer context measured (``crossover``). A crossover that moves with the rows
says a route by context too would pay; one context for every row count, a route by rows
suffices.
"""

from __future__ import annotations

import argparse
from importlib.metadata import version

import torch
from triton_attention import SHAPE, case, kv_bytes  # benchmarks/ is sys.path[0]

from outrider.daemon.bench.roofline import read_bandwidth
from outrider.plugins.registry import named_spec

# The cells above this many K/V bytes of one layer are skipped (the grid's corner at 256 rows
# and 8,192 positions is 8.6 GB).
MAX_CASE_BYTES = 16 << 30


def crossover(times: dict[tuple[int, int], tuple[float, float]]) -> dict[int, int | None]:
    """For each row count of ``times`` ((rows, context) -> (first's, second's) microseconds),
    the shortest context from which the second backend is faster at that context and every
    longer one measured; None where the first is faster at the longest."""
    found: dict[int, int | None] = {}
    for rows in sorted({rows for rows, _ in times}):
        contexts = sorted(context for r, context in times if r == rows)
        since: int | None = None
        for context in reversed(contexts):
            first, second = times[rows, context]
            if second >= first:
                break
            since = context
        found[rows] = since
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs=2, default=["triton", "fa4"], metavar="NAME")
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 32, 64, 128, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    parser.add_argument("--page-size", type=int, default=16)
    args = parser.parse_args()
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {version('triton')}")
    peak = read_bandwidth("cuda") / 1e9  # GB/s
    print(f"read rate (a 4 GiB sum): {peak:,.0f} GB/s; pages of {args.page_size}")
    backends = []
    for name in args.backends:
        spec = named_spec("attention", name)
        backends.append(spec.load()(SHAPE, spec.parse_options(None), device))
    first, second = args.backends
    print(f"rows context | {first} us (% of read) | {second} us (% of read) | faster")
    times: dict[tuple[int, int], tuple[float, float]] = {}
    for rows in args.rows:
        for context in args.contexts:
            read = kv_bytes(rows, context)
            if read > MAX_CASE_BYTES:
                continue
            one = case(rows, context, 1, args.page_size)
            a, b = (one.us(backend) for backend in backends)
            del one
            times[rows, context] = (a, b)
            print(
                f"{rows:4} {context:7} | {a:8.1f} ({100 * read / a / 1e3 / peak:4.1f} %) | "
                f"{b:8.1f} ({100 * read / b / 1e3 / peak:4.1f} %) | {first if a <= b else second}"
            )
    for rows, since in crossover(times).items():
        where = "never" if since is None else f"from {since}"
        print(f"{rows:4} rows: {second} faster {where}")


if __name__ == "__main__":
    main()
