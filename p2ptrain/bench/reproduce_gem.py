"""`p2ptrain reproduce gem`: seed 001 §4.1-4.2 at a size that runs here.

For each worker count n, asynchronous workers around one parameter server apply GEM, DOWNPOUR
(π = 1) and adaptive staleness (Δθ / (τ + 1)); the synchronous momentum-SGD proxy (one process,
torch.optim.SGD with the same η and μ) is the target they are compared to. η = 0.05, μ = 0.9,
worker batch 64 as in the seed; the table holds the workers' final training loss and the test
accuracy of the server's final θ. Then the misspecified-η run of §4.2 (η = 0.1). A diverged run
(NaN loss) is a result, printed as such. Expected shape: GEM stable and close to the proxy as n
grows; DOWNPOUR degrades or diverges; adaptive staleness stable but slower.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from p2ptrain.bench.clusters import VariantResult, fmt, print_table, run_variant

POLICIES = ("gem", "downpour", "adaptive-staleness")


def add_arguments(parser) -> None:
    parser.add_argument("--workers", default="4,8,16,32", help="comma-separated worker counts (default 4,8,16,32)")
    parser.add_argument("--steps", type=int, default=150, help="steps (commits) per worker (default 150)")
    parser.add_argument("--lr", type=float, default=0.05, help="η (default 0.05, the seed's)")
    parser.add_argument("--misspecified-lr", type=float, default=0.1,
                        help="η of the §4.2 run (default 0.1; 0 skips it)")
    parser.add_argument("--misspecified-workers", type=int, default=32,
                        help="workers in the §4.2 run (default 32: where DOWNPOUR diverges at η = 0.1 here)")
    parser.add_argument("--model", default="mlp", help="model (default mlp; the seed's CNN: cnn)")
    parser.add_argument("--batch-size", type=int, default=64, help="worker batch b (default 64, the seed's)")
    parser.add_argument("--num-train", type=int, default=12000, help="training samples (default 12000)")
    parser.add_argument("--extra", default="", help="more node flags for every run, one string")
    parser.add_argument("--out", default="runs/reproduce-gem", help="run folders (default runs/reproduce-gem)")
    parser.add_argument("--timeout", type=float, default=1800, help="per-run timeout in seconds (default 1800)")
    parser.add_argument("--json", action="store_true", help="also print the results as JSON")


def main(args) -> int:
    try:
        counts = [int(w) for w in args.workers.split(",") if w.strip()]
    except ValueError:
        counts = []
    if not counts or any(n < 1 for n in counts):
        print(f"p2ptrain reproduce gem: --workers must be positive integers, got {args.workers!r}", file=sys.stderr)
        return 2
    out = Path(args.out)
    results: dict[tuple[str, int, float], VariantResult] = {}

    def run(policy: str, workers: int, lr: float) -> None:
        name = f"{policy} n={workers} lr={lr:g}"
        print(f"  running {name} ...", file=sys.stderr, flush=True)
        common = ["--model", args.model, "--batch-size", str(args.batch_size), "--num-train", str(args.num_train),
                  "--lr", str(lr), "--momentum", "0.9", "--log-every", str(max(1, args.steps // 10)),
                  *args.extra.split()]
        if policy == "proxy":  # one process, no server: the synchronous momentum-SGD target
            results[(policy, workers, lr)] = run_variant(
                name, 1, args.steps, ["--algorithm", "gem", "--role", "worker", "--ps-policy", "proxy", *common],
                out, timeout=args.timeout, echo=lambda t: print(t, file=sys.stderr))
            return
        results[(policy, workers, lr)] = run_variant(
            name, workers, args.steps, ["--algorithm", "gem", "--ps-policy", policy, *common], out,
            timeout=args.timeout, parameter_server=True, echo=lambda t: print(t, file=sys.stderr))

    run("proxy", 1, args.lr)
    for workers in counts:
        for policy in POLICIES:
            run(policy, workers, args.lr)
    if args.misspecified_lr > 0:
        run("proxy", 1, args.misspecified_lr)
        for policy in ("gem", "downpour"):
            run(policy, args.misspecified_workers, args.misspecified_lr)
    report(results, counts, args, sys.stdout)
    if args.json:
        print(json.dumps([{"policy": k[0], "workers": k[1], "lr": k[2], **v.to_dict()} for k, v in results.items()],
                         indent=2, default=str))
    return 0


def report(results, counts, args, stream) -> None:
    def cell(key) -> str:
        r = results.get(key)
        if r is None:
            return "-"
        if r.error:
            return "failed"
        return f"{fmt(r.final_loss, '{:.3f}')} / {fmt(r.test_accuracy, '{:.3f}')}"

    proxy = cell(("proxy", 1, args.lr))
    print(f"eta = {args.lr:g}: final training loss / test accuracy (proxy: {proxy})", file=stream)
    rows = [[policy] + [cell((policy, n, args.lr)) for n in counts] for policy in POLICIES]
    print_table(rows, ["policy"] + [f"n={n}" for n in counts], stream)
    if args.misspecified_lr > 0:
        n = args.misspecified_workers
        print(f"\nmisspecified eta = {args.misspecified_lr:g}, n = {n}: proxy "
              f"{cell(('proxy', 1, args.misspecified_lr))}", file=stream)
        for policy in ("gem", "downpour"):
            print(f"  {policy}: {cell((policy, n, args.misspecified_lr))}", file=stream)
