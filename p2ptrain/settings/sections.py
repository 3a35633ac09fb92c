"""The settings of a node in groups, one frozen dataclass per concern, each checking its own fields.

A setting is declared once, as a field with setting(default, help, ...): its name is its identity
(flag --name-with-dashes, TOML key, env P2PTRAIN_<NAME>, NodeConfig.<name>), its type says what
values it takes (Literal: the names of p2ptrain/choices.py), its help is its flag's. No name is
in two groups (SETTINGS refuses it at import). Checks that involve two groups (the role and the
algorithm, ranks named in a spec and the world size, ...) are NodeConfig's, in one place.
Nothing here imports torch or gRPC, except where a check needs the code that reads the setting
(the TLS files: p2ptrain/transport/security.py).
"""
from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, NamedTuple, Union, get_type_hints

from p2ptrain.addresses import is_host, is_host_port, is_port, is_wildcard, split_optional_port
from p2ptrain.algorithms import registry
from p2ptrain.choices import (
    DATA_PLANE_NAMES,
    DATASET_NAMES,
    DEVICE_NAMES,
    IDX_DATASETS,
    MODEL_NAMES,
    OPTIMIZER_NAMES,
    ROLE_NAMES,
    DataPlane,
    DatasetName,
    Device,
    Meet,
    ModelName,
    OptimizerName,
    Reachability,
    Role,
)
from p2ptrain.settings.parsers import (
    AtStep,
    LinkBurst,
    Slowdown,
    SlowWindow,
    link_entries,
    parse_relay_routes,
    parse_relays,
)
from p2ptrain.topology import TOPOLOGY_NAMES


class ConfigError(ValueError):
    """A setting that is missing, malformed or inconsistent; the message says which and why."""


def need(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def parsed(what: str, parse: Callable[..., Any], *args: Any) -> Any:
    """parse(*args), its ValueError as a ConfigError saying which setting: "what: reason"."""
    try:
        return parse(*args)
    except ValueError as exc:
        raise ConfigError(f"{what}: {exc}") from None


@dataclass(frozen=True)
class SettingInfo:
    """How a setting shows up on the command line."""

    help: str                       # "{default}" is replaced by the default
    metavar: str | None = None
    flags: tuple[str, ...] = ()     # its spellings, the first one canonical (default: --name-with-dashes)
    choices: tuple[str, ...] | None = None  # for a str setting whose names live elsewhere (a Literal has its own)
    per_node: bool = False          # differs per process: `p2ptrain node` takes it, launchers set it themselves


def setting(default: Any, help: str, *, repr: bool = True, **info: Any) -> Any:
    """A field of a settings group: its default and how it shows up as a flag (SettingInfo);
    repr=False keeps a secret out of the settings' repr."""
    metadata = {"setting": SettingInfo(help, **info)}
    if isinstance(default, (list, dict)):
        return field(default_factory=type(default), repr=repr, metadata=metadata)
    return field(default=default, repr=repr, metadata=metadata)


# -- the groups ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ClusterSettings:
    """Who this node is and how it finds the others: rank, peers or a rendezvous store, the
    elastic membership, and its role (a peer, or a parameter server and its workers)."""

    rank: int = setting(0, "this node's rank (env RANK)", per_node=True)
    world_size: int = setting(1, "number of nodes (env WORLD_SIZE)", per_node=True)
    peers: list[str] = setting([], "comma-separated host:port of every node in rank order", per_node=True)
    listen: str | None = setting(None, "bind address, default [::]:<own port from --peers> (with a rendezvous: "
                                       "[::]:0, a free port the OS picks, published to the store)", per_node=True)
    rendezvous: str | None = setting(
        None, "without --peers: find the peers through the c10d TCPStore at HOST:PORT (default under torchrun or "
              "with MASTER_ADDR/MASTER_PORT set: that store; when nothing answers there, a node on HOST with rank "
              "0, or with none given, hosts it); ranks not given (RANK, SLURM_PROCID, --rank) are handed out by the "
              "store in arrival order", metavar="HOST:PORT", per_node=True)
    advertise: str | None = setting(
        None, "the address peers reach this node at, published to the rendezvous store (default: the host of "
              "--listen, else the local address that routes to the store; PORT: the bound port)",
        metavar="HOST[:PORT]", per_node=True)
    run_id: str = setting("p2ptrain", "name of this run in the rendezvous store, so jobs sharing a store do not "
                                      "mix (default TORCHELASTIC_RUN_ID under torchrun, else {default})",
                          metavar="ID", per_node=True)
    role: Role = setting("peer", "peer: decentralized node; ps: parameter server for --world-size workers (same as "
                                 "`p2ptrain ps`); worker: asynchronous worker --rank of the server at --ps-address "
                                 "(default {default})", per_node=True)
    ps_address: str | None = setting(None, "the parameter server (workers connect to it; the server listens on its "
                                           "port unless --listen is given)",
                                     metavar="HOST:PORT", flags=("--ps-address", "--ps"), per_node=True)
    max_nodes: int | None = setting(
        None, "elastic run: up to N nodes; ranks from the world size up to N-1 join while it runs (--join), and a "
              "node leaves gracefully on SIGTERM (hands over its push-sum mass; the others switch topology or "
              "re-form their ring at one agreed step) (default: static)", metavar="N")
    join: bool = setting(False, "this node joins a running elastic cluster as a new member: it takes a live peer's "
                                "state and starts training at the step all members switch to the larger view "
                                "(`launch --join` sets it)", per_node=True)
    join_at: int | None = setting(None, "with --join: start (imports, data, server) now, and join once the cluster "
                                        "reaches STEP, so the join happens at that step and not seconds later "
                                        "(`launch --join` sets it)", metavar="STEP", per_node=True)
    rejoin: bool = setting(False, "this process restarts into a running cluster: take a live peer's state, or exit "
                                  "at once (code 3) when no peer answers (`launch --restart` sets it)", per_node=True)

    @property
    def slots(self) -> int:
        """Ranks a node of this run may have: max_nodes in an elastic run, else the world size."""
        return self.max_nodes if self.max_nodes is not None else self.world_size

    @property
    def elastic(self) -> bool:
        """Nodes may join (up to max_nodes) and leave (SIGTERM) while the run goes on."""
        return self.max_nodes is not None

    @property
    def uses_rendezvous(self) -> bool:
        """This node finds its peers through a rendezvous store instead of a peer list."""
        return self.role == "peer" and not self.peers and self.rendezvous is not None

    def validate(self) -> None:
        need(self.world_size >= 1, f"world_size must be >= 1, got {self.world_size}")
        need(self.max_nodes is None or self.max_nodes >= self.world_size,
             f"max_nodes {self.max_nodes} is below the world size {self.world_size}")
        need(0 <= self.rank < self.slots, f"rank {self.rank} outside 0..{self.slots - 1}")
        need(self.rank < self.world_size or self.join,
             f"rank {self.rank} is beyond the {self.world_size} starting nodes: a node that joins later needs --join")
        need(not self.join or self.elastic, "--join needs an elastic run: give --max-nodes (every node the same)")
        need(self.join_at is None or (self.join and self.join_at >= 0), "--join-at STEP needs --join and STEP >= 0")
        need(self.role in ROLE_NAMES, f"unknown role {self.role!r}; choose from {ROLE_NAMES}")
        self._validate_rendezvous()
        if self.role == "peer" and not self.uses_rendezvous and (self.world_size > 1 or self.peers):
            need(bool(self.peers), "no --peers and no rendezvous: set --rendezvous HOST:PORT or run under torchrun "
                                   "(or give --peers host:port,... in rank order)")
            need(len(self.peers) == self.slots,
                 f"--peers lists {len(self.peers)} addresses but world size is {self.slots}: "
                 "give one host:port per node, in rank order" + (" (one per rank up to --max-nodes)"
                                                                 if self.elastic else ""))
            for address in self.peers:
                need(is_host_port(address), f"peer address {address!r} is not host:port")
            need(len(set(self.peers)) == len(self.peers), "peer addresses must be distinct")
        need(self.ps_address is None or is_host_port(self.ps_address),
             f"ps_address {self.ps_address!r} is not host:port")
        need(self.role != "ps" or bool(self.listen or self.ps_address),
             "the parameter server needs --listen or --ps-address")

    def _validate_rendezvous(self) -> None:
        if self.rendezvous is not None:
            need(self.role == "peer", "--rendezvous is for peer nodes (a parameter-server worker finds its server "
                                      "through --ps-address)")
            need(not self.peers, "give --peers or --rendezvous, not both")
            need(is_host_port(self.rendezvous), f"rendezvous {self.rendezvous!r} is not HOST:PORT")
        if self.advertise is not None:
            try:
                host, port = split_optional_port(self.advertise)
            except ValueError:
                host, port = "", None
            need(is_host(host) and (port is None or is_port(port)),
                 f"advertise {self.advertise!r} is not HOST or HOST:PORT")
            need(not is_wildcard(host),
                 f"advertise {self.advertise!r} is a wildcard; give the address peers reach this node at")
        need(bool(self.run_id) and self.run_id.isprintable() and not any(c.isspace() for c in self.run_id),
             f"run_id {self.run_id!r} must be non-empty, without spaces")


# Learning rates measured to train each built-in model well with momentum 0.9 (the CNN diverges
# towards ~60% accuracy at 0.05 on the synthetic task, reaches ~93% at 0.01).
DEFAULT_LR = {"mlp": 0.05, "cnn": 0.01}
# With adamw (DiLoCo's inner optimizer): the MLP measured with diloco on the synthetic task (3e-3 reached
# 0.78 after 60 steps, 1e-3 0.65, 0.05 0.15); the CNN's is adamw's usual default, not measured here.
DEFAULT_ADAMW_LR = {"mlp": 0.003, "cnn": 0.001}


@dataclass(frozen=True)
class TrainingSettings:
    """What the node trains and how: the algorithm (its own options are the registry's dataclass,
    NodeConfig.algorithm_options), the graph, the model, the local optimizer, the device."""

    algorithm: str = setting("sgp", "training algorithm (default {default})")
    topology: str | None = setting(None, "communication graph", choices=TOPOLOGY_NAMES)  # None: the algorithm's
    steps: int = setting(300, "training steps (default {default})")
    model: ModelName = setting("mlp", "model (default {default})")
    hidden: int = setting(128, "MLP hidden width (default {default})")
    optimizer: OptimizerName | None = setting(
        None, "local (DiLoCo: inner) optimizer of the built-in training: sgd (with --momentum), adamw, or muon "
              "(Muon for the hidden matrices, AdamW for the rest, as MuLoCo; adamw's learning rate) (default: the "
              "algorithm's, sgd for the per-step algorithms)", flags=("--optimizer", "--inner-optimizer"))
    lr: float | None = setting(None, "learning rate")  # None: the model's and optimizer's default (DEFAULT_LR)
    momentum: float = setting(0.9, "SGD momentum; for ps workers GEM's μ and the proxy's momentum "
                                   "(default {default})")
    weight_decay: float = setting(0.0, "weight decay of the local optimizer (default {default})")
    seed: int = setting(0, "seed of model init, data and shards (default {default})")
    device: Device = setting("auto", "auto = cuda when available, else cpu (default {default})")
    threads: int = setting(1, "torch threads per node process (default {default})")

    @property
    def algorithm_spec(self) -> registry.AlgorithmSpec:
        return registry.get(self.algorithm)

    @property
    def resolved_topology(self) -> str:
        default = self.algorithm_spec.default_topology
        if default is None:  # a parameter-server algorithm: a star around the server
            return self.topology or "star"
        return self.topology or default

    @property
    def resolved_optimizer(self) -> str:
        return self.optimizer or self.algorithm_spec.default_optimizer

    @property
    def learning_rate(self) -> float:
        if self.lr is not None:
            return self.lr
        return (DEFAULT_LR if self.resolved_optimizer == "sgd" else DEFAULT_ADAMW_LR)[self.model]

    def validate(self) -> None:
        need(self.algorithm in registry.names(),
             f"unknown algorithm {self.algorithm!r}; choose from {', '.join(registry.names())}")
        need(self.topology is None or self.topology in TOPOLOGY_NAMES,
             f"unknown topology {self.topology!r}; choose from {TOPOLOGY_NAMES}")
        need(self.steps >= 1, "steps must be >= 1")
        need(self.model in MODEL_NAMES, f"unknown model {self.model!r}; choose from {MODEL_NAMES}")
        need((self.lr is None or self.lr >= 0) and self.momentum >= 0 and self.weight_decay >= 0,
             "lr, momentum, weight_decay must be >= 0")
        need(self.device in DEVICE_NAMES, f"unknown device {self.device!r}; choose from {DEVICE_NAMES}")
        need(self.optimizer is None or self.optimizer in OPTIMIZER_NAMES,
             f"unknown optimizer {self.optimizer!r}; choose from {OPTIMIZER_NAMES}")
        need(self.threads >= 1, "threads must be >= 1")


@dataclass(frozen=True)
class DataSettings:
    """The data set, this node's shard of it, and the batches it is read in."""

    dataset: DatasetName = setting("synthetic", "data set (default {default})")
    data_dir: str | None = setting(None, "folder with MNIST-style IDX files (for --dataset mnist or idx)")
    num_train: int | None = setting(None, "limit/size of the training set (all nodes together)")
    num_test: int | None = setting(None, "limit/size of the held-out test set")
    dirichlet_alpha: float | None = setting(
        None, "non-IID shards: Dirichlet(ALPHA) split of each class over nodes; smaller = more skewed (default: IID "
              "shards)", metavar="ALPHA")
    batch_size: int = setting(32, "per-node batch size (default {default})")

    def validate(self) -> None:
        need(self.dataset in DATASET_NAMES, f"unknown dataset {self.dataset!r}; choose from {DATASET_NAMES}")
        need(self.dataset not in IDX_DATASETS or bool(self.data_dir),
             f"--dataset {self.dataset} needs --data-dir with IDX files")
        need(not self.data_dir or os.path.isdir(self.data_dir), f"data_dir {self.data_dir!r} is not a folder")
        need(self.dirichlet_alpha is None or (0 < self.dirichlet_alpha < math.inf),
             f"dirichlet_alpha must be a positive finite number, got {self.dirichlet_alpha}")
        need(self.batch_size >= 1, "batch_size must be >= 1")


@dataclass(frozen=True)
class TransportSettings:
    """How messages move: chunking, timeouts, the step window and lag limit, relays, the data plane.
    They may differ per node (none is in the fingerprint)."""

    chunk_mb: float = setting(4.0, "stream chunk size in MiB (default {default})")
    peer_timeout: float = setting(120.0, "seconds to wait for a peer's message (default {default})")
    step_window: int = setting(64, "accept messages whose step is within ± this many steps (default {default})")
    link_deadline: float = setting(
        10.0, "longest wait for a peer's message of one step; after it the link counts as dropped for that step "
              "(push-sum shares that come later are folded in; a peer that then does not answer a probe is "
              "considered dead) (default {default})", metavar="SECONDS")
    max_lag: int | None = setting(
        None, "a peer this many steps behind is neither sent to nor waited for, and a node this far behind the "
              "cluster (e.g. after a stall) catches up through a state transfer (default max(16, "
              "(overlap+1)*(world_size-1)+1))", metavar="STEPS")
    relay_routes: list[str] = setting(
        [], "send SRC's messages for DST through relay VIA (then VIA2, ...): 0->3:1, or 0<->3:1 for both directions "
            "(the way back reverses the relays); repeatable",
        metavar="SRC->DST:VIA[,VIA2]", flags=("--relay-route", "--relay-routes"))
    relays: str | None = setting(
        None, "relay candidates for peers found unreachable by a failed connect: 1,2 (then any peer reached "
              "directly), or 'any'; turns on fast-failing direct connects (default: off, a blocked link still falls "
              "back to peers reached directly)", metavar="RANKS|any")
    relay_retry_after: float = setting(30.0, "how long a link found unreachable is left to relays before a direct "
                                             "try (default {default:g})", metavar="SECONDS")
    data_plane: DataPlane = setting(
        "auto", "how tensor payloads travel: auto = over a direct TCP lane per peer pair where both nodes offer one "
                "(negotiated in Hello; token and TLS apply), else gRPC streaming; grpc = gRPC streaming only; tcp = "
                "lanes required (a peer without one is an error) (default {default})")
    lane_port: int = setting(0, "port of this node's TCP lane, on the host of --listen (default 0: a free port, "
                                "advertised to peers in Hello)", metavar="PORT", per_node=True)
    shared_memory: bool = setting(True, "lane payloads between processes of one host (one network namespace) go "
                                        "through shared memory, which skips the TCP stack (never under TLS; "
                                        "--no-shared-memory: over TCP) (default on)")
    reachability: Reachability = setting(
        "auto", "whether peers can dial this node at its address: auto = ask one or two peers to dial it back at "
                "start; public / private = say so without asking (a node behind NAT or a firewall is private) "
                "(default {default})", per_node=True)
    meet: Meet = setting(
        "everyone", "whom a node greets and waits for at start: everyone = every peer (O(n) Hellos per node); "
                    "neighbours = only the peers its algorithm sends to or hears from (SGP: its topology's, "
                    "O(log n) on the exponential graph; other algorithms still wait for every peer), for clusters "
                    "of hundreds; then nobody lays private peers out apart, and a process restarted by other means "
                    "than `p2ptrain launch` must be told --rejoin (default {default})")

    @property
    def chunk_bytes(self) -> int:
        return int(self.chunk_mb * 1024 * 1024)

    def validate(self) -> None:
        need(0.004 <= self.chunk_mb <= 64, f"chunk_mb must be within [0.004, 64], got {self.chunk_mb}")
        need(self.peer_timeout > 0, "peer_timeout must be > 0")
        need(0 < self.link_deadline < math.inf, f"link_deadline must be > 0 seconds, got {self.link_deadline}")
        need(self.max_lag is None or 1 <= self.max_lag < self.step_window,
             f"max_lag must be within [1, step_window={self.step_window}), got {self.max_lag}")
        need(0 < self.relay_retry_after < math.inf,
             f"relay_retry_after must be > 0 seconds, got {self.relay_retry_after}")
        self.relay_plan()
        need(self.data_plane in DATA_PLANE_NAMES,
             f"unknown data_plane {self.data_plane!r}; choose from {DATA_PLANE_NAMES}")
        need(0 <= self.lane_port < 65536, f"lane_port must be a port number (0: any free one), got {self.lane_port}")
        need(self.data_plane != "grpc" or not self.lane_port,
             f"lane_port {self.lane_port} is set but data_plane grpc offers no TCP lane")

    def relay_plan(self, world_size: int | None = None) -> tuple[dict, tuple[int, ...] | None]:
        """The relay routes and candidates, parsed (their ranks checked when `world_size` is given)."""
        return (parsed("relay forwarding", parse_relay_routes, self.relay_routes, world_size),
                parsed("relay forwarding", parse_relays, self.relays, world_size))


@dataclass(frozen=True)
class FaultSettings:
    """Emulated trouble, off by default, may differ per node: slower machines, a NaN loss, WAN
    links (their spec grammar is the emulator's, p2ptrain/transport/faults.py), and windows of steps
    in which a link or a machine is worse (each node applies those that concern it)."""

    slowdown: str | None = setting(
        None, "emulate slower machines: every step's compute takes FACTOR times as long, on every node or per rank "
              "(e.g. 0=4,3=2: node 0 four times slower, node 3 twice) (default 1)",
        metavar="FACTOR|RANK=FACTOR,...")
    inject_nan: str | None = setting(None, "fault injection: node RANK's loss becomes NaN at STEP (the run must then "
                                           "fail, naming the node and step)", metavar="RANK@STEP")
    link: str | None = setting(None, "emulate a WAN on every outgoing link: comma-separated bandwidth=200mbit (or "
                                     "25MB/s), latency=5ms, jitter=1ms, drop=0.01 (default: off)", metavar="SPEC")
    link_overrides: list[str] = setting(
        [], "a spec for one link on top of --link: 0->1:latency=50ms (one direction) or 0<->1:drop=0.1 (both); "
            "repeatable, later ones apply on top; 0<->2:block cuts a link (the peer is then reached through a relay)",
        metavar="SRC->DST:SPEC", flags=("--link-override", "--link-overrides"))
    link_bursts: list[str] = setting(
        [], "a link spec on top of --link/--link-override for steps STEP..STEP+STEPS-1 of the sending node: "
            "0<->2@100+20:block (relays kick in), 0->1@50+10:drop=0.5 (one direction); repeatable",
        metavar="SRC->DST@STEP+STEPS:SPEC", flags=("--link-burst", "--link-bursts"))
    slow_windows: list[str] = setting(
        [], "node RANK's compute FACTOR times slower for steps STEP..STEP+STEPS-1 (on top of --slowdown), e.g. "
            "1@100+30:4; repeatable", metavar="RANK@STEP+STEPS:FACTOR", flags=("--slow", "--slow-windows"))

    def slowdown_plan(self) -> Slowdown:
        return parsed(f"slowdown {self.slowdown!r}", Slowdown.parse, self.slowdown)

    def slow_plan(self) -> tuple[SlowWindow, ...]:
        """The slow windows, parsed (their ranks are NodeConfig's to check)."""
        return tuple(parsed("compute slow-down", SlowWindow.parse, entry) for entry in self.slow_windows)

    def nan_injection(self) -> AtStep | None:
        """(rank, step) of the injected NaN loss, if any."""
        return parsed(f"inject_nan {self.inject_nan!r}", AtStep.parse, self.inject_nan) if self.inject_nan else None

    def validate(self) -> None:
        self.slowdown_plan()
        self.nan_injection()
        self.slow_plan()
        for entry in link_entries(self.link_bursts):  # (the specs are checked with the link table)
            parsed("link emulation", LinkBurst.parse, entry)


@dataclass(frozen=True)
class SecuritySettings:
    """TLS and the shared-secret token of every RPC, all off by default. The token never enters
    the fingerprint, repr, to_dict() or any report: prefer auth_token_file or env
    P2PTRAIN_AUTH_TOKEN over --auth-token, which process listings show."""

    tls_cert: str | None = setting(None, "certificate (chain) this node / server presents; enables TLS",
                                   metavar="PEM")
    tls_key: str | None = setting(None, "private key of --tls-cert", metavar="PEM")
    tls_ca: str | None = setting(None, "CA bundle trusted for peers' and the parameter server's certificates "
                                       "(default: system roots); a worker with only --tls-ca talks TLS to the server",
                                 metavar="PEM")
    tls_server_name: str | None = setting(
        None, "host name to expect in server certificates when it differs from the address (e.g. certificates "
              "issued for a DNS name, peers given by IP)", metavar="NAME")
    tls_require_client_cert: bool = setting(False, "mutual TLS: servers refuse clients without a certificate signed "
                                                   "by --tls-ca")
    auth_token: str | None = setting(
        None, "shared secret every RPC must carry (refused with UNAUTHENTICATED otherwise); visible in process "
              "listings: prefer --auth-token-file or env P2PTRAIN_AUTH_TOKEN", metavar="TOKEN", repr=False)
    auth_token_file: str | None = setting(None, "file holding the shared secret", metavar="FILE")

    @property
    def enabled(self) -> bool:
        return bool(self.tls_cert or self.tls_key or self.tls_ca or self.tls_server_name
                    or self.tls_require_client_cert or self.auth_token is not None or self.auth_token_file)

    def validate(self) -> None:
        if not self.enabled:
            return
        need((self.tls_cert is None) == (self.tls_key is None), "--tls-cert and --tls-key come together")
        for name in ("tls_cert", "tls_key", "tls_ca", "auth_token_file"):
            path = getattr(self, name)
            need(path is None or (os.path.isfile(path) and os.access(path, os.R_OK)),
                 f"{name} {path!r} is not a readable file")
        need(not (self.auth_token is not None and self.auth_token_file),
             "give the auth token once: --auth-token (env P2PTRAIN_AUTH_TOKEN) or --auth-token-file")
        need(not self.tls_require_client_cert or bool(self.tls_ca and self.tls_cert),
             "--tls-require-client-cert needs --tls-ca (to check client certificates) and --tls-cert/--tls-key")
        need(not self.tls_server_name or bool(self.tls_ca or self.tls_cert),
             "--tls-server-name only applies to TLS: give --tls-ca (and --tls-cert/--tls-key)")
        from p2ptrain.transport.security import security_from_settings  # reads and checks the files

        try:
            security_from_settings(self)
        except ValueError as exc:  # SecurityError: an empty token, a token file that is not text, ...
            raise ConfigError(str(exc)) from None


@dataclass(frozen=True)
class OutputSettings:
    """What the node tells the world: /metrics, progress lines, evaluations, the run folder."""

    metrics_port: int | None = setting(None, "serve Prometheus /metrics on this port (0 = any free)", per_node=True)
    metrics_host: str | None = setting(
        None, "address /metrics listens on (default: the host of --listen, so a node or parameter server listening "
              "on 127.0.0.1 keeps its metrics there; 0.0.0.0 when --listen is a wildcard or not given, and for "
              "workers)", metavar="HOST", per_node=True)
    log_every: int = setting(10, "progress/snapshot interval in steps (default {default})")
    eval_every: int = setting(0, "built-in training: also evaluate the test accuracy every STEPS steps (off the step "
                                 "clock: step times and CPU per step leave it out) (default 0: at the end only)",
                              metavar="STEPS")
    out: str | None = setting(None, "folder for progress, summary and snapshot files", per_node=True)

    def validate(self) -> None:
        need(self.log_every >= 1, "log_every must be >= 1")
        need(self.eval_every >= 0, "eval_every must be >= 0 (0: evaluate at the end only)")
        need(self.metrics_port is None or 0 <= self.metrics_port < 65536, "metrics_port must be a port number")
        need(self.metrics_host is None or is_host(self.metrics_host),
             f"metrics_host {self.metrics_host!r} is not a host name or IP address (the port is metrics_port)")


# NodeConfig's attribute -> its group, in the order of --help and of to_dict()
SECTIONS: dict[str, type] = {"cluster": ClusterSettings, "training": TrainingSettings, "data": DataSettings,
                             "transport": TransportSettings, "faults": FaultSettings, "security": SecuritySettings,
                             "output": OutputSettings}


class Setting(NamedTuple):
    """One setting: its name, the group holding it, its type (resolved), default and flag."""

    name: str
    section: str
    type: Any
    default: Any
    info: SettingInfo

    @property
    def choices(self) -> tuple[str, ...] | None:
        """The names it takes: its Literal's, or those its declaration names."""
        return literal_names(self.type) or self.info.choices


def unwrap(kind: Any) -> tuple[bool, Any]:
    """What a resolved annotation says about values: (whether None is allowed, the type a value is
    read as: int, float, bool, list, or str for str and Literal alike)."""
    if typing.get_origin(kind) in (Union, types.UnionType):
        rest = [a for a in typing.get_args(kind) if a is not type(None)]
        return len(rest) < len(typing.get_args(kind)), unwrap(rest[0])[1]
    if typing.get_origin(kind) is Literal:
        return False, str
    return False, typing.get_origin(kind) or kind


def literal_names(kind: Any) -> tuple[str, ...] | None:
    """The names a Literal annotation (or a Literal | None) allows; None for other types."""
    if typing.get_origin(kind) is Literal:
        return typing.get_args(kind)
    return next((names for a in typing.get_args(kind) if (names := literal_names(a))), None)


def _collect() -> dict[str, Setting]:
    table: dict[str, Setting] = {}
    for section, group in SECTIONS.items():
        hints = get_type_hints(group)
        for f in dataclasses.fields(group):
            if f.name in table:
                raise TypeError(f"setting {f.name!r} is declared by both {table[f.name].section} and {section}")
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            table[f.name] = Setting(f.name, section, hints[f.name], default, f.metadata["setting"])
    return table


SETTINGS: dict[str, Setting] = _collect()  # every setting by name, in SECTIONS order

__all__ = ["DEFAULT_ADAMW_LR", "DEFAULT_LR", "SECTIONS", "SETTINGS", "ClusterSettings", "ConfigError", "DataSettings",
           "FaultSettings", "OutputSettings", "SecuritySettings", "Setting", "SettingInfo", "TrainingSettings",
           "TransportSettings", "literal_names", "need", "parsed", "setting", "unwrap"]
