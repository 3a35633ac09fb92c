"""`p2ptrain bench algorithms`: every algorithm on the same model, data and emulated links.

Each variant is a real cluster of node processes; links are capped and delayed by the transport's
link emulation so a single machine can stand in for a communication-bound network. The table
gives the step time after warm-up (mean, p50, p95, max), wall seconds per step, payload bytes per
step per node, final test accuracy and ratios of mean step times to ring all-reduce, then checks the
targets of the seeds (000: overlap and 1-peer SGP vs AR-SGD; 004: Pipe-SGD with 8-bit quantization
vs synchronous all-reduce).
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from p2ptrain.bench.clusters import VariantResult, fmt, print_table, run_variant

# name -> node flags; names are what --variants selects
VARIANTS: dict[str, list[str]] = {
    "allreduce": ["--algorithm", "allreduce"],
    "dpsgd": ["--algorithm", "dpsgd"],
    "sgp-tau0": ["--algorithm", "sgp", "--overlap", "0", "--peers-per-step", "1"],
    "sgp-tau1": ["--algorithm", "sgp", "--overlap", "1", "--peers-per-step", "1"],
    # trunc16: seed 004's 16-bit truncation, called "fp16" (and these variants "-fp16") before fp16 meant IEEE half
    "sgp-tau1-trunc16": ["--algorithm", "sgp", "--overlap", "1", "--peers-per-step", "1",
                         "--share-compression", "trunc16"],
    "relaysgd": ["--algorithm", "relaysgd"],
    "pipesgd": ["--algorithm", "pipesgd"],
    "pipesgd-trunc16": ["--algorithm", "pipesgd", "--compression", "trunc16"],
    "pipesgd-int8": ["--algorithm", "pipesgd", "--compression", "int8"],
    # the ring pipelined in 256 KiB chunks (collectives.py): pays where hops have latency
    "allreduce-chunked": ["--algorithm", "allreduce", "--ring-chunk-kb", "256"],
    "pipesgd-int8-chunked": ["--algorithm", "pipesgd", "--compression", "int8", "--ring-chunk-kb", "256"],
}

DEFAULT_VARIANTS = ("allreduce", "dpsgd", "sgp-tau0", "sgp-tau1", "relaysgd", "pipesgd", "pipesgd-trunc16",
                    "pipesgd-int8")

# (description, numerator, denominator, maximum ratio)
TARGETS = [
    ("SGP tau=1 vs SGP tau=0", "sgp-tau1", "sgp-tau0", 0.6),
    ("1-peer SGP tau=0 vs ring all-reduce", "sgp-tau0", "allreduce", 0.6),
    ("1-peer SGP tau=1 vs ring all-reduce", "sgp-tau1", "allreduce", 0.6),
    ("Pipe-SGD int8 vs synchronous all-reduce", "pipesgd-int8", "allreduce", 0.5),
]


def add_arguments(parser) -> None:
    parser.add_argument("--nodes", type=int, default=8, help="cluster size (default 8)")
    parser.add_argument("--bandwidth", default="200mbit",
                        help="emulated per-link bandwidth, e.g. 200mbit, 25MB/s (default 200mbit)")
    parser.add_argument("--latency", default="5ms", help="emulated one-way latency per link (default 5ms)")
    parser.add_argument("--jitter", default="0ms", help="latency jitter, uniform ± (default 0ms)")
    parser.add_argument("--steps", type=int, default=60, help="training steps per variant (default 60)")
    parser.add_argument("--model", default="mlp", help="model (default mlp)")
    parser.add_argument("--hidden", type=int, default=640,
                        help="MLP width; the default makes one model 3.7 MB (0.92 M parameters), so a transfer at "
                             "200mbit "
                             "takes about as long as a step's compute on 8 nodes sharing 2 cores")
    parser.add_argument("--batch-size", type=int, default=32, help="per-node batch size (default 32)")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                        help=f"comma-separated subset of {','.join(VARIANTS)} (default {','.join(DEFAULT_VARIANTS)})")
    parser.add_argument("--extra", default="", help="more node flags for every variant, one string")
    parser.add_argument("--out", default="runs/bench-algorithms", help="run folders (default runs/bench-algorithms)")
    parser.add_argument("--timeout", type=float, default=900, help="per-variant timeout in seconds (default 900)")
    parser.add_argument("--json", action="store_true", help="also print the results as JSON")


def main(args) -> int:
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown or not names:
        print(f"p2ptrain bench algorithms: unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}",
              file=sys.stderr)
        return 2
    link = f"bandwidth={args.bandwidth},latency={args.latency},jitter={args.jitter}"
    common = ["--model", args.model, "--hidden", str(args.hidden), "--batch-size", str(args.batch_size),
              "--link", link, "--log-every", str(max(1, args.steps // 5)), *args.extra.split()]
    print(f"bench algorithms: {args.nodes} nodes, links {link}, {args.model} hidden {args.hidden}, "
          f"{args.steps} steps per variant", file=sys.stderr)
    results: list[VariantResult] = []
    for name in names:
        print(f"  running {name} ...", file=sys.stderr, flush=True)
        result = run_variant(name, args.nodes, args.steps, [*VARIANTS[name], *common], Path(args.out),
                             timeout=args.timeout, echo=lambda text: print(text, file=sys.stderr))
        if result.error:
            print(f"  {name} failed: {result.error}", file=sys.stderr)
        results.append(result)
    report(results, sys.stdout)
    if args.json:
        print(json.dumps([r.to_dict() for r in results], indent=2, default=str))
    return 0 if not any(r.error for r in results) else 1


def ratios_to(results: list[VariantResult], baseline: str = "allreduce") -> dict[str, float]:
    by_name = {r.name: r for r in results}
    base = by_name.get(baseline)
    if base is None or not math.isfinite(base.step_seconds):
        return {}
    return {r.name: r.step_seconds / base.step_seconds for r in results}


def check_targets(results: list[VariantResult]) -> list[tuple[str, float, float, bool]]:
    by_name = {r.name: r.step_seconds for r in results}
    checks = []
    for description, num, den, limit in TARGETS:
        if num in by_name and den in by_name and math.isfinite(by_name[num]) and by_name[den] > 0:
            ratio = by_name[num] / by_name[den]
            checks.append((description, ratio, limit, ratio <= limit))
    return checks


def report(results: list[VariantResult], stream) -> None:
    ratios = ratios_to(results)
    rows = [[r.name, *(fmt(x * 1000, "{:.1f}") for x in (r.step_seconds, r.step_p50, r.step_p95, r.step_max,
                                                          r.wall_per_step)),
             fmt(r.bytes_per_step / 1e6, "{:.2f}"), fmt(r.test_accuracy, "{:.3f}"), fmt(ratios.get(r.name), "{:.2f}"),
             r.error or ""]
            for r in results]
    print("step ms after warm-up: mean (x AR and the targets use it), p50, p95, max; wall/step: the slowest "
          "node's training ms per step, warm-up included", file=stream)
    print_table(rows, ["variant", "mean step ms", "p50", "p95", "max", "wall/step", "MB/step/node", "test acc",
                       "x AR", "error"], stream)
    checks = check_targets(results)
    if checks:
        print(file=stream)
        for description, ratio, limit, ok in checks:
            print(f"{'PASS' if ok else 'MISS'}  {description}: {ratio:.2f}x (target <= {limit}x)", file=stream)
