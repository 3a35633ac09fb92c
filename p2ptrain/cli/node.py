"""`p2ptrain node`: run one node (a peer, or a parameter-server worker or server by --role)."""
from __future__ import annotations

import argparse
import sys

from p2ptrain.addresses import is_wildcard, split_address
from p2ptrain.cli.flags import add_node_arguments, config_from_args
from p2ptrain.exit_codes import EXIT_NO_CLUSTER, EXIT_NON_FINITE
from p2ptrain.settings import ConfigError, NodeConfig


def add_parser(subcommands) -> None:
    parser = subcommands.add_parser("node", help="run one training node",
                                    description="Run one p2ptrain node. Settings: defaults < --config TOML < "
                                                "environment (RANK, WORLD_SIZE, P2PTRAIN_<SETTING>) < flags.")
    add_node_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    config = check_ports(config_from_args(args))  # before importing torch: a taken port is said at once
    if config.role == "ps":
        return serve_parameter_server(config)
    if config.role == "worker":
        from p2ptrain.ps.worker import run_worker

        summary = run_worker(config)
        print(f"worker {config.rank} ({config.algorithm_options.ps_policy}): test accuracy "
              f"{summary['test_accuracy']:.4f}, final "
              f"loss {summary['final_loss']}, mean staleness {summary.get('mean_staleness')}, "
              f"median pi {summary.get('pi_median')}")
        return 0
    from p2ptrain.node import NoClusterToRejoin, run_node
    from p2ptrain.train.optimizer import NonFiniteError
    from p2ptrain.transport.rendezvous import RendezvousError, assign_rank

    try:
        if config.uses_rendezvous:
            config = assign_rank(config)  # the store hands out a rank when no source gave one
        summary = run_node(config)
    except RendezvousError as exc:
        print(f"p2ptrain node: {exc}", file=sys.stderr)
        return 1
    except NoClusterToRejoin as exc:
        print(f"p2ptrain node: {exc}", file=sys.stderr)
        return EXIT_NO_CLUSTER
    except NonFiniteError as exc:
        print(f"p2ptrain node: run failed: {exc}", file=sys.stderr)
        return EXIT_NON_FINITE
    print(f"node {config.rank}: test accuracy {_fmt(summary.get('test_accuracy'), '.4f')}, final loss "
          f"{_fmt(summary.get('final_loss'), '.4f')}, {_fmt(summary.get('mean_step_seconds'), '.1f', 1000)} ms/step"
          + (f", left the cluster at step {summary['left_at']}" if summary.get("left_at") is not None else ""))
    return 0


def serve_parameter_server(config: NodeConfig) -> int:
    """Serve θ to the workers until they are done; 0 when every worker finished."""
    from p2ptrain.ps.run import run_ps

    summary = run_ps(config)
    print(f"parameter server: {summary['commits']} commits from {summary['workers_done']}/{summary['workers']} "
          f"workers, mean staleness {summary['mean_staleness']}, test accuracy {summary['test_accuracy']:.4f}")
    return 0 if summary["complete"] else 1


def check_ports(config: NodeConfig) -> NodeConfig:
    """Fail at once, in one line, when this node's gRPC or metrics port is taken (not after
    loading data and building the model, with a long gRPC traceback); `config` when both are free.
    A restarted process (rejoin) whose metrics port was taken meanwhile (another process's
    ephemeral port, say) serves on a free one instead, with a warning: its peers know its gRPC
    address, not its metrics, and failing would cost the cluster a member."""
    import socket

    wanted = []
    listen = config.listen or (config.peers[config.rank] if config.peers and config.role == "peer" else None)
    address = split_address(listen) if listen else None
    if address is not None:
        wanted.append(("listen", *address))
    if config.metrics_port:
        wanted.append(("metrics", config.metrics_bind_host, config.metrics_port))
    for what, host, port in wanted:
        if port == 0:
            continue
        if is_wildcard(host):  # taken if taken on the IPv4 wildcard
            bind_host, family = "0.0.0.0", socket.AF_INET
        else:
            bind_host, family = host, socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((bind_host, port))
            except OSError as exc:
                problem = f"cannot {'listen' if what == 'listen' else 'serve metrics'} on {host}:{port}: " \
                          f"{exc.strerror or exc}"
                if what == "metrics" and config.rejoin:
                    print(f"p2ptrain: warning: {problem}; serving them on a free port instead", file=sys.stderr)
                    config = config.replace(metrics_port=0)
                    continue
                raise ConfigError(problem) from None
    return config


def _fmt(value, spec: str, scale: float = 1.0) -> str:
    """`value` formatted, or "-" when the run has none (a node that joined after the last step)."""
    return format(value * scale, spec) if isinstance(value, (int, float)) else "-"


__all__ = ["add_parser", "check_ports", "run", "serve_parameter_server"]
