"""`p2ptrain simulate`: many logical nodes in a few processes, measuring membership costs (bench/simulate.py)."""
from __future__ import annotations

from p2ptrain.choices import MEET_NAMES
from p2ptrain.cli.bench import main_of


def add_parser(subcommands) -> None:
    simulate = subcommands.add_parser(
        "simulate", help="many logical nodes in a few processes: what membership costs per node as n grows",
        description="Run --nodes logical nodes (real transports on loopback, a vector of --dim floats, no model) "
                    "in --processes processes; print per node the control calls (Hello, Settle, DialBack) "
                    "against tensor messages, open channels, the time until all are ready, push-sum's consensus "
                    "distance against the exact theory and Σ w, and what one node leaving costs per node and "
                    "how long until every node holds the new view. Writes OUT/simulate.json.")
    simulate.add_argument("--nodes", type=int, default=16, help="logical nodes (default 16)")
    simulate.add_argument("--processes", type=int, default=2, help="processes hosting them (default 2)")
    simulate.add_argument("--algorithm", choices=("sgp",), default="sgp",
                          help="sgp: push-sum on the exponential graph, one out-peer per step, τ = 0")
    simulate.add_argument("--meet", choices=MEET_NAMES, default="neighbours",
                          help="whom each node greets and waits for at start: neighbours = the peers its topology "
                               "sends to or hears from (O(log n) on the exponential graph), everyone = every peer "
                               "(O(n), as a run without --meet neighbours) (default neighbours)")
    simulate.add_argument("--steps", type=int, default=16,
                          help="steps whose consensus distance is measured (default 16)")
    simulate.add_argument("--dim", type=int, default=64, help="floats in each node's vector (default 64)")
    simulate.add_argument("--window", type=int, default=24,
                          help="steps of the baseline window and of the window in which the last node leaves "
                               "(default 24: beyond the view margin of 8)")
    simulate.add_argument("--churn", type=int, default=0, metavar="EVENTS",
                          help="after the change window, EVENTS times a random member leaves as a new node joins "
                               "(it takes a member's state and is admitted by a view), spread evenly over "
                               "--churn-steps; reports the calls per node per event, the churn rate per minute it "
                               "came to, how fast each view reached every node, and Σ w (default 0: none)")
    simulate.add_argument("--churn-steps", type=int, default=0, metavar="STEPS",
                          help="steps the churn lasts (default 0; at least --churn)")
    simulate.add_argument("--seed", type=int, default=0, help="which members the churn takes (default 0)")
    simulate.add_argument("--loop-per-node", action="store_true",
                          help="give every node its own event loop thread, as real nodes have (default: one loop per "
                               "process for all its nodes; hundreds of loop threads starve each other on few cores)")
    simulate.add_argument("--grpc-calls", action="store_true",
                          help="the nodes of a process call each other (Hello, Settle) by gRPC, as real nodes do "
                               "(default: on a shared loop they call each other's service in-process, serialized as "
                               "gRPC would; counted alike)")
    simulate.add_argument("--sweep", metavar="N1,N2,...",
                          help="run each node count in turn, fit the exponents in n of the control calls and bytes "
                               "per node per change, the calls at start and the channels, and plot OUT/scale.png "
                               "(overrides --nodes)")
    simulate.add_argument("--out", default="runs/simulate", help="where simulate.json goes (default runs/simulate)")
    simulate.add_argument("--timeout", type=float, default=600.0,
                          help="seconds one simulation may take; past them it stops every node and exits 1 "
                               "(Ctrl-C or SIGTERM: 130) (default 600)")
    simulate.set_defaults(func=main_of("p2ptrain.bench.simulate"))


__all__ = ["add_parser"]
