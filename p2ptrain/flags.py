"""The command-line flags of a node (argparse), built from NodeConfig's fields and the algorithm
registry's options. Flags default to None, so an unspecified flag never overrides TOML or the
environment (NodeConfig.from_sources merges them)."""
from __future__ import annotations

import argparse
from dataclasses import fields
from typing import Any

from p2ptrain.algorithms import registry
from p2ptrain.config import (
    ALL_INTERFACES,
    DATA_PLANES,
    DATASETS,
    DEFAULT_LR,
    DEVICES,
    MODELS,
    OPTIMIZERS,
    ROLES,
    NodeConfig,
)
from p2ptrain.topology import TOPOLOGY_NAMES


def add_node_arguments(parser: argparse.ArgumentParser, *, cluster_flags: bool = True) -> None:
    """The node's flags; defaults are None so that unspecified flags do not override TOML/env."""
    d = NodeConfig()
    g = parser.add_argument_group("cluster")
    if cluster_flags:
        g.add_argument("--rank", type=int, help="this node's rank (env RANK)")
        g.add_argument("--world-size", type=int, help="number of nodes (env WORLD_SIZE)")
        g.add_argument("--peers", help="comma-separated host:port of every node in rank order")
        g.add_argument("--listen", help="bind address, default [::]:<own port from --peers> (with a rendezvous: "
                                        "[::]:0, a free port the OS picks, published to the store)")
        g.add_argument("--rendezvous", metavar="HOST:PORT",
                       help="without --peers: find the peers through the c10d TCPStore at HOST:PORT (default under "
                            "torchrun or with MASTER_ADDR/MASTER_PORT set: that store; when nothing answers there, a "
                            "node on HOST with rank 0, or with none given, hosts it); ranks not given (RANK, "
                            "SLURM_PROCID, --rank) are handed out by the store in arrival order")
        g.add_argument("--advertise", metavar="HOST[:PORT]",
                       help="the address peers reach this node at, published to the rendezvous store (default: the "
                            "host of --listen, else the local address that routes to the store; PORT: the bound "
                            "port)")
        g.add_argument("--run-id", metavar="ID",
                       help="name of this run in the rendezvous store, so jobs sharing a store do not mix (default "
                            "TORCHELASTIC_RUN_ID under torchrun, else p2ptrain)")
    g = parser.add_argument_group("algorithm")
    specs = registry.algorithms()
    g.add_argument("--algorithm", choices=tuple(specs),
                   help=f"training algorithm (default {d.algorithm}): " + "; ".join(
                       f"{name}: {spec.summary}" for name, spec in specs.items()))
    g.add_argument("--topology", choices=TOPOLOGY_NAMES,
                   help="communication graph; default per algorithm: " + ", ".join(
                       f"{name} {spec.default_topology}" for name, spec in specs.items() if spec.default_topology))
    add_algorithm_options(g)
    g = parser.add_argument_group("parameter server (GEM, seed 001)")
    if cluster_flags:
        g.add_argument("--role", choices=ROLES,
                       help="peer: decentralized node; ps: parameter server for --world-size workers (same as "
                            "`p2ptrain ps`); worker: asynchronous worker --rank of the server at --ps-address "
                            f"(default {d.role})")
        g.add_argument("--ps-address", "--ps", dest="ps_address", metavar="HOST:PORT",
                       help="the parameter server (workers connect to it; the server listens on its port "
                            "unless --listen is given)")
    g = parser.add_argument_group("training")
    g.add_argument("--steps", type=int, help=f"training steps (default {d.steps})")
    g.add_argument("--model", choices=MODELS, help=f"model (default {d.model})")
    g.add_argument("--hidden", type=int, help=f"MLP hidden width (default {d.hidden})")
    g.add_argument("--dataset", choices=DATASETS, help=f"data set (default {d.dataset})")
    g.add_argument("--data-dir", help="folder with MNIST-style IDX files (for --dataset mnist)")
    g.add_argument("--num-train", type=int, help="limit/size of the training set (all nodes together)")
    g.add_argument("--num-test", type=int, help="limit/size of the held-out test set")
    g.add_argument("--dirichlet-alpha", type=float, metavar="ALPHA",
                   help="non-IID shards: Dirichlet(ALPHA) split of each class over nodes; smaller = more "
                        "skewed (default: IID shards)")
    g.add_argument("--batch-size", type=int, help=f"per-node batch size (default {d.batch_size})")
    g.add_argument("--optimizer", choices=OPTIMIZERS,
                   help="local optimizer of the built-in training: sgd (with --momentum) or adamw (default: the "
                        "algorithm's, sgd for the per-step algorithms)")
    g.add_argument("--lr", type=float,
                   help="learning rate (default per model: "
                        + ", ".join(f"{m} {v}" for m, v in DEFAULT_LR.items()) + ")")
    g.add_argument("--momentum", type=float,
                   help=f"SGD momentum; for ps workers GEM's μ and the proxy's momentum (default {d.momentum})")
    g.add_argument("--weight-decay", type=float, help=f"SGD weight decay (default {d.weight_decay})")
    g.add_argument("--seed", type=int, help=f"seed of model init, data and shards (default {d.seed})")
    g.add_argument("--device", choices=DEVICES, help="auto = cuda when available, else cpu (default auto)")
    g.add_argument("--threads", type=int, help=f"torch threads per node process (default {d.threads})")
    g = parser.add_argument_group("transport")
    g.add_argument("--chunk-mb", type=float, help=f"stream chunk size in MiB (default {d.chunk_mb})")
    g.add_argument("--peer-timeout", type=float,
                   help=f"seconds to wait for a peer's message (default {d.peer_timeout})")
    g.add_argument("--link-deadline", type=float, metavar="SECONDS",
                   help="longest wait for a peer's message of one step; after it the link counts as dropped "
                        "for that step (push-sum shares that come later are folded in; a peer that then does "
                        f"not answer a probe is considered dead) (default {d.link_deadline})")
    g.add_argument("--slowdown", metavar="FACTOR|RANK=FACTOR,...",
                   help="emulate slower machines: every step's compute takes FACTOR times as long, on every "
                        "node or per rank (e.g. 0=4,3=2: node 0 four times slower, node 3 twice) (default 1)")
    g.add_argument("--max-lag", type=int, metavar="STEPS",
                   help="a peer this many steps behind is neither sent to nor waited for, and a node this far "
                        "behind the cluster (e.g. after a stall) catches up through a state transfer "
                        "(default max(16, (overlap+1)*(world_size-1)+1))")
    g.add_argument("--max-nodes", type=int, metavar="N",
                   help="elastic run: up to N nodes; ranks from the world size up to N-1 join while it runs "
                        "(--join), and a node leaves gracefully on SIGTERM (hands over its push-sum mass; the "
                        "others switch topology or re-form their ring at one agreed step) (default: static)")
    if cluster_flags:
        g.add_argument("--join", action="store_true", default=None,
                       help="this node joins a running elastic cluster as a new member: it takes a live peer's "
                            "state and starts training at the step all members switch to the larger view "
                            "(`launch --join` sets it)")
        g.add_argument("--join-at", type=int, metavar="STEP",
                       help="with --join: start (imports, data, server) now, and join once the cluster reaches "
                            "STEP, so the join happens at that step and not seconds later (`launch --join` sets it)")
        g.add_argument("--rejoin", action="store_true", default=None,
                       help="this process restarts into a running cluster: take a live peer's state, or exit at "
                            "once (code 3) when no peer answers (`launch --restart` sets it)")
    g.add_argument("--inject-nan", metavar="RANK@STEP",
                   help="fault injection: node RANK's loss becomes NaN at STEP (the run must then fail, naming "
                        "the node and step)")
    g.add_argument("--step-window", type=int,
                   help=f"accept messages whose step is within ± this many steps (default {d.step_window})")
    g.add_argument("--link", metavar="SPEC",
                   help="emulate a WAN on every outgoing link: comma-separated bandwidth=200mbit (or 25MB/s), "
                        "latency=5ms, jitter=1ms, drop=0.01 (default: off)")
    g.add_argument("--link-override", "--link-overrides", dest="link_overrides", action=_JoinAppend,
                   metavar="SRC->DST:SPEC",
                   help="a spec for one link on top of --link: 0->1:latency=50ms (one direction) or "
                        "0<->1:drop=0.1 (both); repeatable, later ones apply on top; 0<->2:block cuts a "
                        "link (the peer is then reached through a relay)")
    g.add_argument("--relay-route", "--relay-routes", dest="relay_routes", action=_JoinAppend,
                   metavar="SRC->DST:VIA[,VIA2]",
                   help="send SRC's messages for DST through relay VIA (then VIA2, ...): 0->3:1, or 0<->3:1 "
                        "for both directions (the way back reverses the relays); repeatable")
    g.add_argument("--relays", metavar="RANKS|any",
                   help="relay candidates for peers found unreachable by a failed connect: 1,2 (then any peer "
                        "reached directly), or 'any'; turns on fast-failing direct connects (default: off, "
                        "a blocked link still falls back to peers reached directly)")
    g.add_argument("--relay-retry-after", type=float, metavar="SECONDS",
                   help=f"how long a link found unreachable is left to relays before a direct try (default "
                        f"{d.relay_retry_after:g})")
    g.add_argument("--data-plane", choices=DATA_PLANES,
                   help="how tensor payloads travel: auto = over a direct TCP lane per peer pair where both "
                        "nodes offer one (negotiated in Hello; token and TLS apply), else gRPC streaming; grpc "
                        "= gRPC streaming only; tcp = lanes required (a peer without one is an error) "
                        f"(default {d.data_plane})")
    if cluster_flags:  # per node: a launched cluster's nodes each pick a free port
        g.add_argument("--lane-port", type=int, metavar="PORT",
                       help="port of this node's TCP lane, on the host of --listen (default 0: a free port, "
                            "advertised to peers in Hello)")
    g = parser.add_argument_group("security", "TLS and a shared-secret token for every RPC (default: plaintext, open)")
    g.add_argument("--tls-cert", metavar="PEM", help="certificate (chain) this node / server presents; enables TLS")
    g.add_argument("--tls-key", metavar="PEM", help="private key of --tls-cert")
    g.add_argument("--tls-ca", metavar="PEM",
                   help="CA bundle trusted for peers' and the parameter server's certificates (default: system "
                        "roots); a worker with only --tls-ca talks TLS to the server")
    g.add_argument("--tls-server-name", metavar="NAME",
                   help="host name to expect in server certificates when it differs from the address (e.g. "
                        "certificates issued for a DNS name, peers given by IP)")
    g.add_argument("--tls-require-client-cert", action="store_true", default=None,
                   help="mutual TLS: servers refuse clients without a certificate signed by --tls-ca")
    g.add_argument("--auth-token", metavar="TOKEN",
                   help="shared secret every RPC must carry (refused with UNAUTHENTICATED otherwise); visible "
                        "in process listings: prefer --auth-token-file or env P2PTRAIN_AUTH_TOKEN")
    g.add_argument("--auth-token-file", metavar="FILE", help="file holding the shared secret")
    g = parser.add_argument_group("output")
    if cluster_flags:
        g.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port (0 = any free)")
        g.add_argument("--metrics-host", metavar="HOST",
                       help="address /metrics listens on (default: the host of --listen, so a node or parameter "
                            f"server listening on 127.0.0.1 keeps its metrics there; {ALL_INTERFACES} when "
                            "--listen is a wildcard or not given, and for workers)")
        g.add_argument("--out", help="folder for progress, summary and snapshot files")
    g.add_argument("--log-every", type=int, help=f"progress/snapshot interval in steps (default {d.log_every})")
    g.add_argument("--eval-every", type=int, metavar="STEPS",
                   help="built-in training: also evaluate the test accuracy every STEPS steps (off the step clock: "
                        "step times and CPU per step leave it out) (default 0: at the end only)")
    g.add_argument("--config", dest="config_file", help="TOML file with settings (flags and env override it)")


class _JoinAppend(argparse.Action):
    """A repeatable flag kept as one ";"-joined string (the env form), so that `p2ptrain launch`
    can pass it on to its node processes as a single flag."""

    def __call__(self, parser, namespace, values, option_string=None):
        previous = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, f"{previous};{values}" if previous else values)


def flags_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The settings given as flags (None: not given), for NodeConfig.from_sources."""
    names = {f.name for f in fields(NodeConfig)} | set(registry.all_options())
    return {k: v for k, v in vars(args).items() if k in names}


def node_config_from_argv(prog: str, description: str, argv: list[str] | None = None):
    """A validated NodeConfig from node flags (and --config): for programs that run one rank of a
    cluster the launcher starts with node flags, such as the baselines of `bench peers`."""
    from p2ptrain.config import NodeConfig

    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_node_arguments(parser)
    args = parser.parse_args(argv)
    return NodeConfig.from_sources(toml_path=args.config_file, flags=flags_from_args(args)).validate()


def settings_to_env(settings: dict[str, Any]) -> dict[str, str]:
    """P2PTRAIN_<SETTING> variables for settings given as flags (None: not given), the way
    NodeConfig reads them back (lists comma- or semicolon-joined): how `p2ptrain launch` hands its
    flags to a script of your own. The auth token is never among them (launch passes it apart)."""
    env = {}
    for name, value in settings.items():
        if value is None or name == "auth_token":
            continue
        if isinstance(value, bool):
            text = "1" if value else "0"
        elif isinstance(value, (list, tuple)):
            text = (";" if name in ("link_overrides", "relay_routes") else ",").join(map(str, value))
        else:
            text = str(value)
        env[f"P2PTRAIN_{name.upper()}"] = text
    return env


def add_algorithm_options(group) -> None:
    """One flag per algorithm option (shared by several algorithms: one flag); its help names the
    algorithms that take it, each with its own text where they mean different things (SGP's and
    allreduce's --overlap). Defaults stay None, so only given flags reach NodeConfig."""
    for name, (f, users) in registry.all_options().items():
        info = f.metadata["option"]
        kind = {"int": int, "float": float}.get(str(f.type).split(" ")[0], str)
        default = f.default if f.default is not None else "none"
        helps: dict[str, list[str]] = {}
        for user in users:
            helps.setdefault(registry.get(user).option_fields()[name].metadata["option"].help, []).append(user)
        text = "; ".join(f"{'/'.join(names)}: {help}" for help, names in helps.items())
        if str(f.type).split(" ")[0] == "bool":  # a switch, like --join: given means true, absent means not given
            group.add_argument(f"--{name.replace('_', '-')}", action="store_true", default=None,
                               help=f"{text} (default {'on' if f.default else 'off'})")
            continue
        group.add_argument(f"--{name.replace('_', '-')}", type=kind, choices=info.choices, metavar=info.metavar,
                           help=f"{text} (default {default})")
