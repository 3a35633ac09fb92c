"""The `p2ptrain` command: node, launch, bench.

  p2ptrain node    run one node (flags, env RANK/WORLD_SIZE/P2PTRAIN_*, or --config FILE.toml);
                   --role worker --ps HOST:PORT: an asynchronous parameter-server worker (GEM)
  p2ptrain ps      run a parameter server for --world-size workers (GEM, seed 001)
  p2ptrain launch  run a local cluster of N node processes with live progress and a report
  p2ptrain bench   benchmarks (transport, algorithms)
  p2ptrain reproduce  re-run a figure of the source documents (relaysgd, gem)
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from p2ptrain.config import ConfigError, NodeConfig, add_node_arguments, flags_from_args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="p2ptrain", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    node = sub.add_parser("node", help="run one training node",
                          description="Run one p2ptrain node. Settings: defaults < --config TOML < "
                                      "environment (RANK, WORLD_SIZE, P2PTRAIN_<SETTING>) < flags.")
    add_node_arguments(node)
    node.set_defaults(func=cmd_node)

    ps = sub.add_parser("ps", help="run a parameter server (GEM) for --world-size workers",
                        description="Serve the central variable θ (θ_0 from --model/--hidden/--dataset/--seed) "
                                    "to --world-size asynchronous workers (`p2ptrain node --role worker`), "
                                    "listening on --listen or the port of --ps-address; stop once every "
                                    "worker is done, or after --peer-timeout seconds without any call. "
                                    "Writes OUT/ps.json, OUT/ps.progress.jsonl, OUT/ps.snapshots.pt.")
    add_node_arguments(ps)
    ps.set_defaults(func=cmd_ps)

    launch = sub.add_parser("launch", help="run a local cluster of N node processes",
                            description="Run N node processes on free loopback ports, show live "
                                        "per-node progress, write OUT/report.json and OUT/plot.png.")
    launch.add_argument("--nodes", type=int, required=True, help="number of node processes")
    launch.add_argument("--out", default="runs/latest", help="run folder (default runs/latest)")
    launch.add_argument("--timeout", type=float, default=None, help="abort the run after this many seconds")
    launch.add_argument("--no-metrics", action="store_true", help="do not serve /metrics from the nodes")
    launch.add_argument("--live", dest="live", action="store_true", default=None,
                        help="redraw the progress table in place (default: when stderr is a terminal)")
    launch.add_argument("--no-live", dest="live", action="store_false", help="print plain progress lines")
    add_node_arguments(launch, cluster_flags=False)
    launch.set_defaults(func=cmd_launch)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    transport = bench_sub.add_parser(
        "transport", help="p2ptrain gRPC push vs torch.distributed gloo vs raw TCP",
        description="Move the same float32 payload between two processes with p2ptrain's gRPC push, "
                    "gloo send/recv and a raw TCP socket; print MB/s and ratios.")
    transport.add_argument("--size-mb", type=float, default=64.0, help="payload size in MB (default 64)")
    transport.add_argument("--reps", type=int, default=10, help="timed transfers per method (default 10)")
    transport.add_argument("--rounds", type=int, default=3,
                           help="interleaved rounds per method, medians reported (default 3)")
    transport.add_argument("--chunk-mb", type=float, default=None, help="p2ptrain chunk size in MiB")
    transport.add_argument("--methods", default="p2ptrain,gloo,tcp",
                           help="comma-separated subset of p2ptrain,gloo,tcp (default all)")
    transport.add_argument("--json", action="store_true", help="print JSON instead of a table")
    transport.set_defaults(func=cmd_bench_transport)

    from p2ptrain.bench import algorithms as bench_algorithms

    algorithms = bench_sub.add_parser(
        "algorithms", help="every algorithm on the same model, data and emulated links",
        description=bench_algorithms.__doc__.split("\n\n")[1].replace("\n", " "))
    bench_algorithms.add_arguments(algorithms)
    algorithms.set_defaults(func=cmd_bench_algorithms)

    from p2ptrain.bench import reproduce

    repro = sub.add_parser("reproduce", help="re-run a figure of the source documents",
                           description="Re-run an experiment of the seeds at a size that runs here in minutes.")
    repro_sub = repro.add_subparsers(dest="experiment", required=True, metavar="EXPERIMENT")
    relay = repro_sub.add_parser("relaysgd", help="seed 003 fig. 5.2: AllReduce vs D-PSGD vs RelaySGD over "
                                                  "Dirichlet alpha", description=reproduce.__doc__)
    reproduce.add_arguments(relay)
    relay.set_defaults(func=cmd_reproduce_relaysgd)

    from p2ptrain.bench import reproduce_gem

    gem = repro_sub.add_parser("gem", help="seed 001 §4.1-4.2: GEM vs DOWNPOUR vs adaptive staleness vs the "
                                           "synchronous proxy over worker counts", description=reproduce_gem.__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    reproduce_gem.add_arguments(gem)
    gem.set_defaults(func=cmd_reproduce_gem)
    return parser


def _config_from_args(args: argparse.Namespace, **overrides) -> NodeConfig:
    flags = flags_from_args(args)
    flags.update(overrides)
    return NodeConfig.from_sources(toml_path=getattr(args, "config_file", None), flags=flags)


def cmd_node(args: argparse.Namespace) -> int:
    from p2ptrain.node import run_node

    config = _config_from_args(args)
    if config.role == "ps":
        return _serve_ps(config)
    if config.role == "worker":
        from p2ptrain.ps.worker import run_worker

        summary = run_worker(config)
        print(f"worker {config.rank} ({config.ps_policy}): test accuracy {summary['test_accuracy']:.4f}, final "
              f"loss {summary['final_loss']}, mean staleness {summary.get('mean_staleness')}, "
              f"median pi {summary.get('pi_median')}")
        return 0
    summary = run_node(config)
    print(f"node {config.rank}: test accuracy {summary['test_accuracy']:.4f}, final loss "
          f"{summary['final_loss']:.4f}, {summary['mean_step_seconds'] * 1000:.1f} ms/step")
    return 0


def cmd_ps(args: argparse.Namespace) -> int:
    return _serve_ps(_config_from_args(args, role="ps"))


def _serve_ps(config: NodeConfig) -> int:
    from p2ptrain.ps.server import run_ps

    summary = run_ps(config)
    print(f"parameter server: {summary['commits']} commits from {summary['workers_done']}/{summary['workers']} "
          f"workers, mean staleness {summary['mean_staleness']}, test accuracy {summary['test_accuracy']:.4f}")
    return 0 if summary["complete"] else 1


def _node_flags_as_argv(args: argparse.Namespace) -> list[str]:
    """Re-emit the node flags the user gave to `launch`, for every node process."""
    parser = argparse.ArgumentParser(add_help=False)
    add_node_arguments(parser, cluster_flags=False)
    argv: list[str] = []
    for action in parser._actions:  # the one place that knows flag spellings
        if not action.option_strings:
            continue
        value = getattr(args, action.dest, None)
        if value is not None:
            argv += [action.option_strings[0], str(value)]
    return argv


def cmd_launch(args: argparse.Namespace) -> int:
    from launcher import run_local_cluster
    from launcher.local import ClusterError

    if args.nodes < 1:
        raise ConfigError("--nodes must be >= 1")
    gem = args.algorithm == "gem"
    if gem:  # one parameter server + --nodes workers
        config = _config_from_args(args, world_size=args.nodes, rank=0, role="worker",
                                   ps_address="127.0.0.1:20000")  # validate early
    else:
        placeholder_peers = [f"127.0.0.1:{20000 + i}" for i in range(args.nodes)]
        config = _config_from_args(args, world_size=args.nodes, rank=0, peers=placeholder_peers)
    shown = {k: v for k, v in config.to_dict().items() if k not in ("rank", "peers", "listen", "out",
                                                                    "metrics_port", "role", "ps_address")}
    node_args = _node_flags_as_argv(args)
    extra = {}
    if gem:
        from launcher.local import parameter_server_cluster

        extra = parameter_server_cluster(args.nodes, Path(args.out), node_args, metrics=not args.no_metrics)
    try:
        report = run_local_cluster(args.nodes, Path(args.out), node_args, config=shown,
                                   metrics=not args.no_metrics, live=args.live, timeout=args.timeout, **extra)
    except ClusterError as exc:
        print(f"p2ptrain launch: {exc}", file=sys.stderr)
        return 1
    cluster = report.get("cluster", {})
    acc = cluster.get("mean_test_accuracy")
    cd = cluster.get("consensus_distance")
    print(f"mean test accuracy {acc if acc is None else f'{acc:.4f}'}, consensus distance "
          f"{cd if cd is None else f'{cd:.3g}'}, wall {cluster.get('wall_seconds', 0):.1f}s")
    return 0


def cmd_bench_transport(args: argparse.Namespace) -> int:
    from p2ptrain.bench.transport import main as bench_main

    return bench_main(args)


def cmd_bench_algorithms(args: argparse.Namespace) -> int:
    from p2ptrain.bench.algorithms import main as bench_main

    return bench_main(args)


def cmd_reproduce_relaysgd(args: argparse.Namespace) -> int:
    from p2ptrain.bench.reproduce import main as reproduce_main

    return reproduce_main(args)


def cmd_reproduce_gem(args: argparse.Namespace) -> int:
    from p2ptrain.bench.reproduce_gem import main as reproduce_main

    return reproduce_main(args)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ConfigError as exc:
        parser.exit(2, f"p2ptrain: configuration error: {exc}\n")
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
