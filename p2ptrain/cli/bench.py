"""`p2ptrain bench`: benchmarks (transport, algorithms, peers, heal)."""
from __future__ import annotations

import argparse
import importlib
from typing import Callable


def add_parser(subcommands) -> None:
    from p2ptrain.bench import algorithms as bench_algorithms
    from p2ptrain.bench import peers as bench_peers

    bench = subcommands.add_parser("bench", help="benchmarks")
    benchmarks = bench.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    transport = benchmarks.add_parser(
        "transport", help="p2ptrain gRPC streaming and TCP lane vs torch.distributed gloo vs raw TCP",
        description="Move the same float32 payload between two processes with p2ptrain's gRPC streaming "
                    "(grpc), its TCP lane (lane), gloo send/recv and a raw TCP socket; print MB/s, CPU-s/GB "
                    "and ratios.")
    transport.add_argument("--size-mb", type=float, default=64.0, help="payload size in MB (default 64)")
    transport.add_argument("--reps", type=int, default=10, help="timed transfers per method (default 10)")
    transport.add_argument("--rounds", type=int, default=3,
                           help="interleaved rounds per method, medians reported (default 3)")
    transport.add_argument("--chunk-mb", type=float, default=None, help="gRPC streaming's chunk size in MiB")
    transport.add_argument("--methods", default="grpc,lane,shm,gloo,tcp",
                           help="comma-separated subset of grpc,lane,shm,gloo,tcp (default all; p2ptrain = grpc; "
                                "shm = the lane through shared memory)")
    transport.add_argument("--json", action="store_true", help="print JSON instead of a table")
    transport.set_defaults(func=main_of("p2ptrain.bench.transport"))

    algorithms = benchmarks.add_parser(
        "algorithms", help="every algorithm on the same model, data and emulated links",
        description=bench_algorithms.__doc__.split("\n\n")[1].replace("\n", " "))
    bench_algorithms.add_arguments(algorithms)
    algorithms.set_defaults(func=main_of("p2ptrain.bench.algorithms"))

    peers = benchmarks.add_parser(
        "peers", help="p2ptrain's algorithms vs torch DDP (gloo) and hivemind: same model, data, batch, nodes",
        description=bench_peers.__doc__.split("\n\n")[1].replace("\n", " "))
    bench_peers.add_arguments(peers)
    peers.set_defaults(func=main_of("p2ptrain.bench.peers"))

    from p2ptrain.bench import heal as bench_heal

    heal = benchmarks.add_parser(
        "heal", help="kill and restart a node under each lockstep algorithm (and torchft when installed)",
        description=bench_heal.__doc__.split("\n\n")[1].replace("\n", " "))
    bench_heal.add_arguments(heal)
    heal.set_defaults(func=main_of("p2ptrain.bench.heal"))


def main_of(module: str) -> Callable[[argparse.Namespace], int]:
    """The run(args) of a benchmark or experiment: `module`.main(args), its module (and torch)
    imported only when it runs."""
    def run(args: argparse.Namespace) -> int:
        return importlib.import_module(module).main(args)

    return run


__all__ = ["add_parser", "main_of"]
