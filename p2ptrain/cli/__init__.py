"""The `p2ptrain` command: node, ps, launch, compose, kubernetes, report, health, pki, bench, reproduce, simulate.

  p2ptrain node    run one node (flags, env RANK/WORLD_SIZE/P2PTRAIN_*, or --config FILE.toml; a GEM worker)
  p2ptrain ps      run a parameter server for --world-size workers (GEM, seed 001)
  p2ptrain launch  run a local cluster of N node processes with live progress and a report
  p2ptrain compose write a docker-compose file: N nodes (+ parameter server), Prometheus, Grafana
  p2ptrain kubernetes  write Kubernetes manifests: StatefulSet (or parameter server + workers), Services, ...
  p2ptrain report  (re)build a run's report.json and plot.png from its folder, or merge one folder per host
  p2ptrain health  ask a node or parameter server whether it is serving (grpc.health.v1); exit 0 if so
  p2ptrain pki     make a run's CA and per-node certificates (mutual TLS: a node speaks only as itself)
  p2ptrain bench   benchmarks (transport, algorithms, peers); reproduce: a figure of the sources (relaysgd, gem, ...)
  p2ptrain simulate  many logical nodes in a few processes: membership costs per node as n grows
"""
from __future__ import annotations

import argparse
import contextlib
import faulthandler
import logging
import signal
import sys

from p2ptrain.cli import bench, compose, health, kubernetes, launch, node, pki, ps, report, reproduce, simulate
from p2ptrain.cli.flags import config_from_args, node_flags_as_argv
from p2ptrain.exit_codes import EXIT_CONFIG
from p2ptrain.settings import ConfigError

# One module per subcommand: add_parser(subparsers) declares it, its run(args) runs it (importing
# torch-heavy modules only there, so that `p2ptrain --help` stays fast).
COMMANDS = (node, ps, launch, compose, kubernetes, report, health, pki, bench, reproduce, simulate)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="p2ptrain", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    subcommands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(subcommands)
    return parser


def command_tree(parser: argparse.ArgumentParser | None = None, path: tuple[str, ...] = ()):
    """(path, parser, is_group) of every command and sub-command below `parser` (default: the
    whole `p2ptrain` parser), e.g. (("bench", "peers"), <parser>, False): what the CLI reference
    documents. argparse has no public walk of its sub-parsers, so this is the one place that reads
    its actions."""
    parser = parser or build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*path, name), sub, _has_subcommands(sub)
                yield from command_tree(sub, (*path, name))


def _has_subcommands(parser: argparse.ArgumentParser) -> bool:
    return any(isinstance(action, argparse._SubParsersAction) for action in parser._actions)


def option_strings(parser: argparse.ArgumentParser) -> list[str]:
    """Every option string (--flag) `parser` takes."""
    return [option for action in parser._actions for option in action.option_strings]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    script: list[str] = []
    if "--" in argv:  # `p2ptrain launch [flags] -- python train.py ARGS`: everything after is the script
        at = argv.index("--")
        argv, script = argv[:at], argv[at + 1:]
    args = parser.parse_args(argv)
    args.script = script
    if script and args.command != "launch":
        parser.error(f"only `p2ptrain launch` runs a script after --, not `p2ptrain {args.command}`")
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command in ("node", "launch"):
        # `kill -USR1 PID` writes every thread's stack to stderr (a node's log): what a process
        # that seems hung waits on. launch does it to a node that ignored SIGTERM before SIGKILL.
        with contextlib.suppress(ValueError, AttributeError):  # (a stderr without a file: called in-process)
            faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        return args.func(args)
    except ConfigError as exc:
        parser.exit(EXIT_CONFIG, f"p2ptrain: configuration error: {exc}\n")
    except KeyboardInterrupt:
        return 130


# Parsed flags -> settings (config_from_args) and -> the node flags a launcher passes on
# (node_flags_as_argv) are p2ptrain/cli/flags.py's, public here too.
__all__ = ["COMMANDS", "build_parser", "command_tree", "config_from_args", "main", "node_flags_as_argv",
           "option_strings"]
