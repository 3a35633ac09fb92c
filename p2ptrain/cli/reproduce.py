"""`p2ptrain reproduce`: re-run a figure of the source documents (relaysgd, gem, diloco)."""
from __future__ import annotations

import argparse

from p2ptrain.cli.bench import main_of


def add_parser(subcommands) -> None:
    from p2ptrain.bench import reproduce, reproduce_diloco, reproduce_gem

    repro = subcommands.add_parser("reproduce", help="re-run a figure of the source documents",
                                   description="Re-run an experiment of the seeds at a size that runs here in "
                                               "minutes.")
    experiments = repro.add_subparsers(dest="experiment", required=True, metavar="EXPERIMENT")
    relay = experiments.add_parser("relaysgd", help="seed 003 fig. 5.2: AllReduce vs D-PSGD vs RelaySGD over "
                                                    "Dirichlet alpha", description=reproduce.__doc__)
    reproduce.add_arguments(relay)
    relay.set_defaults(func=main_of("p2ptrain.bench.reproduce"))

    gem = experiments.add_parser("gem", help="seed 001 §4.1-4.2: GEM vs DOWNPOUR vs adaptive staleness vs the "
                                             "synchronous proxy over worker counts", description=reproduce_gem.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    reproduce_gem.add_arguments(gem)
    gem.set_defaults(func=main_of("p2ptrain.bench.reproduce_gem"))

    diloco = experiments.add_parser("diloco", help="issue 15: AllReduce vs DiLoCo, Streaming DiLoCo, compressed "
                                                   "pseudo-gradients and gossip-DiLoCo over emulated WAN links",
                                    description=reproduce_diloco.__doc__,
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
    reproduce_diloco.add_arguments(diloco)
    diloco.set_defaults(func=main_of("p2ptrain.bench.reproduce_diloco"))


__all__ = ["add_parser"]
