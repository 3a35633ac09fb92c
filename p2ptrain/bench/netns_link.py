"""How fast p2ptrain moves a tensor across a real link between two network namespaces, optionally
capped by the kernel's `tc tbf`: the push measurement of `p2ptrain bench transport`
(p2ptrain.bench.push), each end inside its own namespace of a 2-node launcher.netns cluster.

    sudo python -m p2ptrain.bench.netns_link --bandwidth 50mbit   # rank 0 -> 1 through a 50 Mbit/s cap

Benchmark code (needs root or CAP_NET_ADMIN): nothing here runs during training.
"""
from __future__ import annotations

import argparse
import sys

from launcher.netns import NetnsCluster, NetnsError, NetnsUnavailable, missing_privilege
from p2ptrain.bench.push import bench_p2ptrain_between

PROBE_PORT = 50061  # both ends listen on it, each at its own namespace's address


def measure_throughput(cluster: NetnsCluster, src: int, dst: int, size_bytes: int = 4_000_000,
                       reps: int = 4, timeout: float = 120.0) -> dict:
    """Push a float32 tensor of `size_bytes` from rank `src` to rank `dst` `reps` times, two untimed
    warm-up pushes first (drain the tbf bucket, open the TCP window). A push counts when the
    receiver has acknowledged the whole tensor, so the figure is payload goodput: with a cap it sits
    a few % under it (headers)."""
    if src == dst or not (0 <= src < cluster.size and 0 <= dst < cluster.size):
        raise ValueError(f"need two distinct ranks of {cluster.size}, got {src} -> {dst}")
    try:
        result = bench_p2ptrain_between([f"{cluster.nodes[r].address}:{PROBE_PORT}" for r in (src, dst)],
                                        size_bytes, reps, timeout,
                                        argv_prefixes=[cluster.exec_prefix(src), cluster.exec_prefix(dst)])
    except RuntimeError as exc:
        raise NetnsError(f"throughput probe failed: {exc}") from None
    return {"bytes": size_bytes * reps, "seconds": result.seconds, "mb_per_s": result.mb_per_s,
            "src": src, "dst": dst}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m p2ptrain.bench.netns_link",
                                     description="Build a 2-node netns cluster and measure rank 0 -> 1 throughput.")
    parser.add_argument("--bandwidth", default=None, help="cap, e.g. 50mbit (default: unshaped)")
    parser.add_argument("--size-mb", type=float, default=4.0)
    parser.add_argument("--reps", type=int, default=4)
    args = parser.parse_args(argv)
    reason = missing_privilege()
    if reason:
        print(f"p2ptrain.bench.netns_link: needs root or CAP_NET_ADMIN ({reason})", file=sys.stderr)
        return 1
    from p2ptrain.transport.faults import parse_bandwidth

    try:
        rate = parse_bandwidth(args.bandwidth) if args.bandwidth else None
        with NetnsCluster(2, bandwidth=rate, stream=sys.stderr) as cluster:
            result = measure_throughput(cluster, 0, 1, int(args.size_mb * 1e6) // 4 * 4, args.reps)
    except (NetnsError, NetnsUnavailable, ValueError) as exc:
        print(f"p2ptrain.bench.netns_link: {exc}", file=sys.stderr)
        return 1
    cap = f", cap {rate / 1e6:.3g} MB/s ({result['mb_per_s'] / rate * 1e6:.0%} of it)" if rate else ""
    print(f"rank 0 -> 1: {result['mb_per_s']:.2f} MB/s over {result['bytes'] / 1e6:.0f} MB{cap}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
