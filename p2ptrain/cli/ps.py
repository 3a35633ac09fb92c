"""`p2ptrain ps`: run a parameter server for --world-size workers (GEM, seed 001)."""
from __future__ import annotations

import argparse

from p2ptrain.cli.flags import add_node_arguments, config_from_args
from p2ptrain.cli.node import check_ports, serve_parameter_server


def add_parser(subcommands) -> None:
    parser = subcommands.add_parser(
        "ps", help="run a parameter server (GEM) for --world-size workers",
        description="Serve the central variable θ (θ_0 from --model/--hidden/--dataset/--seed) to --world-size "
                    "asynchronous workers (`p2ptrain node --role worker`), listening on --listen or the port of "
                    "--ps-address; stop once every worker is done, or after --peer-timeout seconds without any "
                    "call. Writes OUT/ps.json, OUT/ps.progress.jsonl, OUT/ps.snapshots.pt.")
    add_node_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args, role="ps")
    config = check_ports(config)
    return serve_parameter_server(config)


__all__ = ["add_parser", "run"]
