"""NodeConfig: every setting of a node as plain data, and where settings come from:
defaults < TOML file < environment < command-line flags.

Environment: P2PTRAIN_<SETTING> for any setting (e.g. P2PTRAIN_PEERS="node0:50051,node1:50051",
P2PTRAIN_OVERLAP=1), which is what docker-compose uses, and below it what launchers set: torchrun's
RANK / WORLD_SIZE (or GROUP_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK), TORCHELASTIC_RUN_ID and
MASTER_ADDR / MASTER_PORT (the rendezvous store, for a node given no peer list), and Slurm's
SLURM_PROCID / SLURM_NTASKS. List settings in one string: peers comma-separated, link_overrides
semicolon-separated.

An algorithm's own options (SGP's overlap, all-reduce's compression, ...) are declared by the
algorithm (p2ptrain/algorithms/registry.py) and travel in `options`; a flag that does not apply to
the chosen algorithm is an error, while a TOML file or environment shared by a whole cluster may
carry other algorithms' options, which are kept in `ignored_options` and reported. This module
builds no transport object and imports no torch (p2ptrain/node.py composes the node; the
command-line flags are p2ptrain/flags.py).
"""
from __future__ import annotations

import dataclasses
import difflib
import hashlib
import ipaddress
import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

import tomllib

from p2ptrain.algorithms import registry
from p2ptrain.algorithms.registry import AlgorithmOptions, AlgorithmSpec
from p2ptrain.topology import TOPOLOGY_NAMES, max_peers_per_step

ROLES = ("peer", "ps", "worker")  # peer: decentralized node; ps / worker: parameter server (GEM, seed 001)
MODELS = ("mlp", "cnn")
DATASETS = ("synthetic", "mnist")
DEVICES = ("auto", "cpu", "cuda")
DATA_PLANES = ("auto", "grpc", "tcp")  # how tensor payloads travel (transport/dataplane.py; options.DataPlane)
OPTIMIZERS = ("sgd", "adamw")  # what `p2ptrain node` builds (a script of your own brings its own)
# Learning rates measured to train each built-in model well with momentum 0.9 (the CNN diverges
# towards ~60% accuracy at 0.05 on the synthetic task, reaches ~93% at 0.01).
DEFAULT_LR = {"mlp": 0.05, "cnn": 0.01}
# With adamw (DiLoCo's inner optimizer): the MLP measured with diloco on the synthetic task (3e-3 reached
# 0.78 after 60 steps, 1e-3 0.65, 0.05 0.15); the CNN's is adamw's usual default, not measured here.
DEFAULT_ADAMW_LR = {"mlp": 0.003, "cnn": 0.001}
# /metrics on every interface: IPv4 only, which binds in every container (IPv6 may be disabled there).
ALL_INTERFACES = "0.0.0.0"
_WILDCARD_HOSTS = ("", "0.0.0.0", "::", "*")
# Settings every node of a cluster must share (checked in Hello), besides the algorithm's own options
# that declare fingerprint=True.
FINGERPRINT_SETTINGS = ("world_size", "max_nodes", "algorithm", "resolved_topology", "model", "hidden", "dataset",
                        "seed", "dirichlet_alpha", "num_train")


class ConfigError(ValueError):
    """A setting that is missing, malformed or inconsistent; the message says which and why."""


@dataclass
class NodeConfig:
    # Identity and cluster
    rank: int = 0
    world_size: int = 1
    peers: list[str] = field(default_factory=list)  # address of every node, indexed by rank
    listen: str | None = None                        # bind address (default: [::]:<own peer port>; with a
                                                     # rendezvous [::]:0, a port the OS picks)
    # Rendezvous (transport/rendezvous.py): how a node given no peer list finds its peers; not in the fingerprint
    rendezvous: str | None = None                    # HOST:PORT of a c10d TCPStore (torchrun's own, or one a node
                                                     # on HOST hosts); env MASTER_ADDR:MASTER_PORT
    advertise: str | None = None                     # HOST[:PORT] peers reach this node at; None: the host of
                                                     # listen, or the local address that routes to the store
    run_id: str = "p2ptrain"                         # namespaces this run's keys in the store (env TORCHELASTIC_RUN_ID)
    # Algorithm
    algorithm: str = "sgp"
    topology: str | None = None                      # None: the algorithm's default (its registry entry)
    options: dict[str, Any] = field(default_factory=dict)  # the algorithm's own settings, by option name
                                                     # (its options dataclass in p2ptrain/algorithms)
    # Parameter server (GEM, seed 001): world_size = number of workers, rank = worker id
    role: str = "peer"                               # peer | ps | worker
    ps_address: str | None = None                    # host:port of the parameter server
    # Training
    steps: int = 300
    model: str = "mlp"
    hidden: int = 128
    dataset: str = "synthetic"
    data_dir: str | None = None
    num_train: int | None = None
    num_test: int | None = None
    dirichlet_alpha: float | None = None             # non-IID Dirichlet(α) class split over nodes; None = IID
    batch_size: int = 32
    optimizer: str | None = None                     # the built-in runs' local optimizer: sgd | adamw; None:
                                                     # the algorithm's default (AlgorithmSpec.default_optimizer)
    lr: float | None = None                          # None: the model's default (DEFAULT_LR, DEFAULT_ADAMW_LR)
    momentum: float = 0.9                            # sgd's momentum (and GEM's μ)
    weight_decay: float = 0.0
    seed: int = 0
    device: str = "auto"
    threads: int = 1                                 # torch intra-op threads per node process
    # Transport
    chunk_mb: float = 4.0
    peer_timeout: float = 120.0
    step_window: int = 64
    link_deadline: float = 10.0                      # longest wait for a peer's message of one step; then
                                                     # the link counts as dropped for that step
    slowdown: str | None = None                      # emulate slower machines: "4" (this node) or "0=4,3=2"
                                                     # (per rank, so one launch flag serves every node)
    max_lag: int | None = None                       # a peer this many steps behind is not sent to or waited
                                                     # for, a node this far behind catches up by a state
                                                     # transfer; None: max(16, (overlap+1)(world_size-1)+1)
    max_nodes: int | None = None                     # elastic run: up to this many nodes; ranks world_size..
                                                     # max_nodes-1 join later (--join); SIGTERM = leave
    join: bool = False                               # this node joins a running elastic cluster as a new member
    join_at: int | None = None                       # with join: start now, join once the cluster reaches this step
    rejoin: bool = False                             # this process restarts into a running cluster: take a
                                                     # live peer's state, or exit at once if none answers
    inject_nan: str | None = None                    # fault injection "RANK@STEP": that node's loss is NaN
    # Link emulation (transport/faults.py); off by default, may differ per node (not in the fingerprint)
    link: str | None = None                          # spec of every outgoing link: "bandwidth=200mbit,latency=5ms"
    link_overrides: list[str] = field(default_factory=list)  # "SRC->DST:SPEC" / "SRC<->DST:SPEC", in order
    # Relay forwarding (transport/relay.py); may differ per node (not in the fingerprint)
    relay_routes: list[str] = field(default_factory=list)  # "SRC->DST:VIA[,VIA2]" / "SRC<->DST:VIA"
    relays: str | None = None                        # relay candidates when a peer proves unreachable: "1,2" / "any"
    relay_retry_after: float = 30.0                  # seconds before a link found unreachable is tried directly again
    # Data plane (transport/dataplane.py, lane.py); may differ per node (not in the fingerprint)
    data_plane: str = "auto"                         # auto: tensors over the peers' TCP lanes where both offer one,
                                                     # else gRPC streaming; grpc: gRPC only; tcp: lanes required
    lane_port: int = 0                               # the TCP lane's port on the listen host (0: the OS picks one)
    # Observability and output
    metrics_port: int | None = None                  # serve Prometheus /metrics here (0 = any free port)
    metrics_host: str | None = None                  # bind /metrics here; None: the host of listen (see
                                                     # metrics_bind_host); not in the fingerprint
    log_every: int = 10
    eval_every: int = 0                              # built-in runs: test accuracy every this many steps
                                                     # too (off the step clock); 0: only at the end
    out: str | None = None
    # Security (transport/security.py): all off by default. The token never goes into the
    # fingerprint, repr, to_dict() or any report; prefer auth_token_file / env P2PTRAIN_AUTH_TOKEN
    # over --auth-token, which process listings show.
    tls_cert: str | None = None                      # PEM cert this node serves with (and offers under mTLS)
    tls_key: str | None = None                       # its PEM private key
    tls_ca: str | None = None                        # PEM CA bundle trusted for peers' / the server's certs
    tls_server_name: str | None = None               # name to expect in server certs instead of the address host
    tls_require_client_cert: bool = False            # servers demand client certs signed by tls_ca (mutual TLS)
    auth_token: str | None = field(default=None, repr=False)  # shared secret every RPC must carry
    auth_token_file: str | None = None               # file holding the token (first line, whitespace stripped)
    # Options of other algorithms that came from a shared TOML file or the environment (a cluster's
    # workers and peers may share one file): kept here, reported at start-up, never applied.
    ignored_options: dict[str, Any] = field(default_factory=dict)
    # False when no source gave a rank: a rendezvous store then assigns one (rendezvous.assign_rank).
    rank_given: bool = field(default=True, compare=False, repr=False)


    # -- the algorithm ----------------------------------------------------------------------------
    @property
    def algorithm_spec(self) -> AlgorithmSpec:
        return registry.get(self.algorithm)

    @property
    def algorithm_options(self) -> AlgorithmOptions:
        """The algorithm's options dataclass, from `options` (validated)."""
        try:
            return self.algorithm_spec.parse_options(self.options, self)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{self.algorithm}: {exc}") from None

    @property
    def resolved_topology(self) -> str:
        default = self.algorithm_spec.default_topology
        if default is None:  # gem: a star around the parameter server
            return self.topology or "star"
        return self.topology or default

    # -- validation -------------------------------------------------------------------------------
    def validate(self) -> "NodeConfig":
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(msg)

        need(self.world_size >= 1, f"world_size must be >= 1, got {self.world_size}")
        need(self.max_nodes is None or self.max_nodes >= self.world_size,
             f"max_nodes {self.max_nodes} is below the world size {self.world_size}")
        need(0 <= self.rank < self.slots, f"rank {self.rank} outside 0..{self.slots - 1}")
        need(self.rank < self.world_size or self.join,
             f"rank {self.rank} is beyond the {self.world_size} starting nodes: a node that joins later needs --join")
        need(not self.join or self.elastic, "--join needs an elastic run: give --max-nodes (every node the same)")
        need(self.join_at is None or (self.join and self.join_at >= 0), "--join-at STEP needs --join and STEP >= 0")
        need(self.role in ROLES, f"unknown role {self.role!r}; choose from {ROLES}")
        self._validate_rendezvous(need)
        if self.role == "peer" and not self.uses_rendezvous and (self.world_size > 1 or self.peers):
            need(bool(self.peers), "no --peers and no rendezvous: set --rendezvous HOST:PORT or run under torchrun "
                                   "(or give --peers host:port,... in rank order)")
            need(len(self.peers) == self.slots,
                 f"--peers lists {len(self.peers)} addresses but world size is {self.slots}: "
                 "give one host:port per node, in rank order" + (" (one per rank up to --max-nodes)"
                                                                 if self.elastic else ""))
            for addr in self.peers:
                host, sep, port = addr.rpartition(":")
                need(bool(sep and host and port.isdigit() and 0 < int(port) < 65536),
                     f"peer address {addr!r} is not host:port")
            need(len(set(self.peers)) == len(self.peers), "peer addresses must be distinct")
        self._validate_algorithm(need)
        self._validate_ps(need)
        need(self.steps >= 1, "steps must be >= 1")
        need(self.model in MODELS, f"unknown model {self.model!r}; choose from {MODELS}")
        need(self.dataset in DATASETS, f"unknown dataset {self.dataset!r}; choose from {DATASETS}")
        need(self.dataset != "mnist" or bool(self.data_dir), "--dataset mnist needs --data-dir with IDX files")
        need(not self.data_dir or os.path.isdir(self.data_dir), f"data_dir {self.data_dir!r} is not a folder")
        need(self.dirichlet_alpha is None or (0 < self.dirichlet_alpha < float("inf")),
             f"dirichlet_alpha must be a positive finite number, got {self.dirichlet_alpha}")
        need(self.batch_size >= 1, "batch_size must be >= 1")
        need((self.lr is None or self.lr >= 0) and self.momentum >= 0 and self.weight_decay >= 0,
             "lr, momentum, weight_decay must be >= 0")
        need(self.device in DEVICES, f"unknown device {self.device!r}; choose from {DEVICES}")
        need(self.optimizer is None or self.optimizer in OPTIMIZERS,
             f"unknown optimizer {self.optimizer!r}; choose from {OPTIMIZERS}")
        need(self.threads >= 1, "threads must be >= 1")
        need(0.004 <= self.chunk_mb <= 64, f"chunk_mb must be within [0.004, 64], got {self.chunk_mb}")
        need(self.peer_timeout > 0, "peer_timeout must be > 0")
        need(0 < self.link_deadline < float("inf"), f"link_deadline must be > 0 seconds, got {self.link_deadline}")
        try:
            self.compute_slowdown
        except ValueError as exc:
            raise ConfigError(f"slowdown {self.slowdown!r}: {exc}") from None
        need(self.max_lag is None or 1 <= self.max_lag < self.step_window,
             f"max_lag must be within [1, step_window={self.step_window}), got {self.max_lag}")
        try:
            self.nan_injection_step
        except ValueError as exc:
            raise ConfigError(f"inject_nan {self.inject_nan!r}: {exc}") from None
        need(self.log_every >= 1, "log_every must be >= 1")
        need(self.eval_every >= 0, "eval_every must be >= 0 (0: evaluate at the end only)")
        need(self.metrics_port is None or 0 <= self.metrics_port < 65536, "metrics_port must be a port number")
        need(self.metrics_host is None or _is_host(self.metrics_host),
             f"metrics_host {self.metrics_host!r} is not a host name or IP address (the port is metrics_port)")
        if self.link or self.link_overrides:
            from p2ptrain.transport.faults import LinkTable  # parsing the specs needs the emulator's grammar

            try:
                LinkTable.parse(self.link, self.link_overrides, seed=self.seed).check_ranks(self.world_size)
            except ValueError as exc:
                raise ConfigError(f"link emulation: {exc}") from None
        self._validate_relays(need)
        need(self.data_plane in DATA_PLANES, f"unknown data_plane {self.data_plane!r}; choose from {DATA_PLANES}")
        need(0 <= self.lane_port < 65536, f"lane_port must be a port number (0: any free one), got {self.lane_port}")
        need(self.data_plane != "grpc" or not self.lane_port,
             f"lane_port {self.lane_port} is set but data_plane grpc offers no TCP lane")
        self._validate_security(need)
        return self

    def _validate_algorithm(self, need) -> None:
        need(self.algorithm in registry.names(),
             f"unknown algorithm {self.algorithm!r}; choose from {', '.join(registry.names())}")
        spec = self.algorithm_spec
        need(self.topology is None or self.topology in TOPOLOGY_NAMES,
             f"unknown topology {self.topology!r}; choose from {TOPOLOGY_NAMES}")
        if spec.role == "parameter-server":
            need(self.role != "peer", f"--algorithm {spec.name} runs as a parameter server (p2ptrain ps) and workers "
                                      "(--role worker), or through p2ptrain launch")
        else:
            served = ", ".join(n for n, s in registry.algorithms().items() if s.role != "peer")
            need(self.role == "peer", f"--role {self.role} is for a parameter-server algorithm ({served}), "
                                      f"not {spec.name}")
            need(self.resolved_topology in spec.topologies,
                 f"{spec.name} cannot run on topology {self.topology!r}; choose from {spec.topologies}")
        options = self.algorithm_options  # raises ConfigError with the algorithm's own reason
        peers_per_step = getattr(options, "peers_per_step", None)
        if self.resolved_topology == "exponential" and peers_per_step is not None:  # fewer members clamp it
            need(peers_per_step <= max_peers_per_step(self.slots),
                 f"--peers-per-step {peers_per_step} exceeds the {self.slots - 1} other nodes of a "
                 f"{self.slots}-node exponential graph")

    def _validate_rendezvous(self, need) -> None:
        if self.rendezvous is not None:
            need(self.role == "peer", "--rendezvous is for peer nodes (a parameter-server worker finds its server "
                                      "through --ps-address)")
            need(not self.peers, "give --peers or --rendezvous, not both")
            need(_is_host_port(self.rendezvous), f"rendezvous {self.rendezvous!r} is not HOST:PORT")
        if self.advertise is not None:
            host, _, port = self.advertise.rpartition(":") if _has_port(self.advertise) else (self.advertise, "", "")
            need(_is_host(host) and (not port or (port.isdigit() and 0 < int(port) < 65536)),
                 f"advertise {self.advertise!r} is not HOST or HOST:PORT")
            need(_unbracket(host) not in _WILDCARD_HOSTS,
                 f"advertise {self.advertise!r} is a wildcard; give the address peers reach this node at")
        need(bool(self.run_id) and self.run_id.isprintable() and not any(c.isspace() for c in self.run_id),
             f"run_id {self.run_id!r} must be non-empty, without spaces")

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

    def _validate_ps(self, need) -> None:
        if self.ps_address is not None:
            host, sep, port = self.ps_address.rpartition(":")
            need(bool(sep and host and port.isdigit() and 0 < int(port) < 65536),
                 f"ps_address {self.ps_address!r} is not host:port")
        if self.role == "ps":
            need(bool(self.listen or self.ps_address), "the parameter server needs --listen or --ps-address")
        need(self.role == "peer" or self.momentum < 1,
             f"momentum μ must be < 1 for a parameter-server worker, got {self.momentum}")

    def _validate_relays(self, need) -> None:
        need(0 < self.relay_retry_after < float("inf"), f"relay_retry_after must be > 0 seconds, got "
                                                          f"{self.relay_retry_after}")
        if not self.relay_routes and self.relays is None:
            return
        from p2ptrain.transport.routes import parse_relay_routes, parse_relays

        try:
            parse_relay_routes(self.relay_routes, self.world_size)
            parse_relays(self.relays, self.world_size)
        except ValueError as exc:
            raise ConfigError(f"relay forwarding: {exc}") from None

    def _validate_security(self, need) -> None:
        if not (self.tls_cert or self.tls_key or self.tls_ca or self.tls_server_name or self.tls_require_client_cert
                or self.auth_token is not None or self.auth_token_file):
            return
        need((self.tls_cert is None) == (self.tls_key is None), "--tls-cert and --tls-key come together")
        for name in ("tls_cert", "tls_key", "tls_ca", "auth_token_file"):
            path = getattr(self, name)
            if path is not None:
                need(os.path.isfile(path) and os.access(path, os.R_OK),
                     f"{name} {path!r} is not a readable file")
        need(not (self.auth_token is not None and self.auth_token_file),
             "give the auth token once: --auth-token (env P2PTRAIN_AUTH_TOKEN) or --auth-token-file")
        if self.role in ("peer", "ps"):  # these serve: TLS needs their own certificate
            need(not self.tls_ca or bool(self.tls_cert),
                 f"a TLS {'parameter server' if self.role == 'ps' else 'node'} needs --tls-cert and --tls-key "
                 "besides --tls-ca")
        need(not self.tls_require_client_cert or bool(self.tls_ca and self.tls_cert),
             "--tls-require-client-cert needs --tls-ca (to check client certificates) and --tls-cert/--tls-key")
        need(not self.tls_server_name or bool(self.tls_ca or self.tls_cert),
             "--tls-server-name only applies to TLS: give --tls-ca (and --tls-cert/--tls-key)")
        from p2ptrain.transport.security import security_from_settings  # reads and checks the files

        try:
            security_from_settings(self)
        except ValueError as exc:  # SecurityError: an empty token, a token file that is not text, ...
            raise ConfigError(str(exc)) from None

    @property
    def metrics_bind_host(self) -> str:
        """Where /metrics listens: metrics_host when given; else the host a node or parameter server
        binds its gRPC server to, so `--listen 127.0.0.1:P` keeps the unauthenticated metrics on
        loopback too; all interfaces when that host is a wildcard or not given (the gRPC default
        [::]:port) and for workers, which serve no gRPC."""
        if self.metrics_host is not None:
            return _unbracket(self.metrics_host)
        if self.role == "worker" or not self.listen:
            return ALL_INTERFACES
        if self.listen.startswith("unix"):  # a Unix socket: only local callers reach the gRPC server
            return "127.0.0.1"
        host = _unbracket(self.listen.rpartition(":")[0])
        return ALL_INTERFACES if host in _WILDCARD_HOSTS else host

    @property
    def compute_slowdown(self) -> float:
        """This node's compute slow-down factor (>= 1) from `slowdown`."""
        return parse_slowdown(self.slowdown, self.world_size).get(self.rank, 1.0)

    @property
    def resolved_max_lag(self) -> int:
        """The lag limit: above what the algorithm's bounded delay can produce on any graph of this size."""
        if self.max_lag is not None:
            return self.max_lag
        delay = self.algorithm_options.bounded_delay()
        return max(1, min(self.step_window - 1, max(16, (delay + 1) * (self.world_size - 1) + 1)))

    @property
    def nan_injection_step(self) -> int | None:
        """The step at which this node's loss is made NaN (`inject_nan` = "RANK@STEP"), if it is this rank."""
        if not self.inject_nan:
            return None
        rank, sep, step = str(self.inject_nan).partition("@")
        if not (sep and rank.strip().isdigit() and step.strip().isdigit()):
            raise ValueError("expected RANK@STEP, e.g. 2@50")
        if not 0 <= int(rank) < self.world_size:
            raise ValueError(f"rank {rank} outside 0..{self.world_size - 1}")
        return int(step) if int(rank) == self.rank else None

    @property
    def resolved_optimizer(self) -> str:
        return self.optimizer or self.algorithm_spec.default_optimizer

    @property
    def learning_rate(self) -> float:
        if self.lr is not None:
            return self.lr
        return (DEFAULT_ADAMW_LR if self.resolved_optimizer == "adamw" else DEFAULT_LR)[self.model]

    @property
    def chunk_bytes(self) -> int:
        return int(self.chunk_mb * 1024 * 1024)

    def fingerprint(self) -> str:
        """Hash of the settings every node of a cluster must share (checked in Hello)."""
        shared = {k: getattr(self, k) for k in FINGERPRINT_SETTINGS}
        options = self.algorithm_options
        shared.update({f.name: getattr(options, f.name) for f in dataclasses.fields(options)
                       if f.metadata["option"].fingerprint})
        return hashlib.sha256(json.dumps(shared, sort_keys=True).encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        """Every setting by the names flags and TOML use (the algorithm's options resolved, with
        their defaults, beside the common ones), for reports and logs; the token is redacted."""
        values = dataclasses.asdict(self)
        del values["options"]
        if not values["ignored_options"]:
            del values["ignored_options"]
        del values["rank_given"]
        values.update(dataclasses.asdict(self.algorithm_options))
        if values.get("auth_token") is not None:
            values["auth_token"] = "<redacted>"
        return values

    # -- sources ----------------------------------------------------------------------------------
    @classmethod
    def from_sources(cls, *, toml_path: str | os.PathLike | None = None, env: Mapping[str, str] | None = None,
                     flags: Mapping[str, Any] | None = None, spelled: Mapping[str, str] = {}) -> "NodeConfig":
        """defaults < TOML < environment < flags (None-valued flags mean 'not given'). A name that
        is neither a setting nor any algorithm's option is an error (with the closest name), and
        so are two sources that disagree on the world size. `spelled` names a flag in messages when
        the command spells it differently (launch: world_size is --nodes)."""
        shared: dict[str, Any] = {}  # from sources a whole cluster may share
        toml = _from_toml(Path(toml_path)) if toml_path else {}
        env = os.environ if env is None else env
        environment = _from_env(env)
        shared.update(toml)
        shared.update(environment)
        options_known = registry.all_options()  # (flags carry the parser's other entries too: skipped)
        given = {k: v for k, v in (flags or {}).items() if v is not None and (k in _FIELDS or k in options_known)}
        _check_agreement("world_size", toml_path, toml, environment, given, spelled, env)
        values = {**shared, **given}
        if values.get("role") in ("ps", "worker") and "algorithm" not in values:
            values["algorithm"] = "gem"  # the parameter-server roles run GEM and its baselines
        if values.get("role", "peer") == "peer" and not values.get("peers"):
            _rendezvous_from_launcher(values, env, given)
        settings = {k: _coerce(k, v, _FIELDS[k].type) for k, v in values.items() if k in _FIELDS}
        algorithm = str(settings.get("algorithm", cls.algorithm))
        taken = registry.get(algorithm).option_fields() if algorithm in registry.names() else {}
        options, ignored = {}, {}
        for name, value in values.items():
            if name in _FIELDS:
                continue
            if name in taken:
                options[name] = _coerce(name, value, taken[name].type)
            elif name in given:
                users = options_known[name][1]
                raise ConfigError(f"--{name.replace('_', '-')} does not apply to {algorithm} (it is an option of "
                                  f"{', '.join(users)})")
            else:
                ignored[name] = value
        try:
            config = cls(**settings, options=options, ignored_options=ignored, rank_given="rank" in values)
        except (TypeError, ValueError) as exc:
            raise ConfigError(str(exc)) from None
        return config.validate()


_FIELDS = {f.name: f for f in fields(NodeConfig) if f.name not in ("options", "ignored_options", "rank_given")}


def _check_agreement(name: str, toml_path, toml: Mapping, environment: Mapping, flags: Mapping,
                     spelled: Mapping[str, str], env: Mapping[str, str]) -> None:
    """A setting two sources give differently is a mistake, not an override (e.g. a world size of 4
    in the TOML, WORLD_SIZE=8 from the environment and --nodes 3): say which is which."""
    present = []
    if toml.get(name) is not None:
        present.append((f"{name} = {toml[name]!r} in {toml_path}", str(toml[name]).strip()))
    if environment.get(name) is not None:
        variable = next((v for v in (f"P2PTRAIN_{name.upper()}", *_LAUNCHER_VARIABLES.get(name, ())) if v in env),
                        name.upper())
        present.append((f"{variable}={environment[name]} in the environment", str(environment[name]).strip()))
    if flags.get(name) is not None:
        flag = spelled.get(name, f"--{name.replace('_', '-')}")
        present.append((f"{flag} {flags[name]}", str(flags[name]).strip()))
    if len({value for _, value in present}) > 1:
        raise ConfigError(f"conflicting {name.replace('_', ' ')}s: " + " vs ".join(where for where, _ in present))


def _unknown_settings(names: list[str]) -> str:
    """"unknown setting(s) [...]" with the closest known name for each, if any is close."""
    known = [*_FIELDS, *registry.all_options()]
    hints = [f"{name!r} -> {close[0]!r}" for name in names
             if (close := difflib.get_close_matches(name, known, n=1))]
    return f"unknown setting(s) {names}" + (f"; did you mean {', '.join(hints)}?" if hints else "")


def parse_slowdown(spec: str | float | None, world_size: int) -> dict[int, float]:
    """"4" -> every rank 4; "0=4,3=2" -> ranks 0 and 3 (others 1). Factors must be finite and >= 1."""
    if spec is None or str(spec).strip() == "":
        return {}
    text = str(spec).strip()
    entries = [e.strip() for e in text.split(",") if e.strip()]
    factors: dict[int, float] = {}
    for entry in entries:
        rank_text, sep, factor_text = entry.rpartition("=")
        try:
            factor = float(factor_text)
        except ValueError:
            raise ValueError(f"{factor_text!r} is not a number (FACTOR or RANK=FACTOR,...)") from None
        if not 1.0 <= factor < float("inf"):
            raise ValueError(f"factor {factor_text} must be >= 1 (1 = full speed)")
        if not sep:
            if len(entries) > 1:
                raise ValueError("give one FACTOR for every node, or RANK=FACTOR entries")
            return {rank: factor for rank in range(world_size)}
        if not rank_text.strip().isdigit() or not 0 <= int(rank_text) < world_size:
            raise ValueError(f"rank {rank_text!r} is not in 0..{world_size - 1}")
        factors[int(rank_text)] = factor
    return factors


def _unbracket(host: str) -> str:
    """"[::1]" (the form in host:port addresses) -> "::1" (the form sockets bind)."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def _has_port(text: str) -> bool:
    """"host:port" / "[v6]:port" rather than a bare host or IPv6 literal."""
    if text.startswith("["):
        return "]:" in text
    return text.count(":") == 1


def _is_host_port(text: str) -> bool:
    host, sep, port = text.rpartition(":")
    return bool(sep and _has_port(text) and _is_host(host) and port.isdigit() and 0 < int(port) < 65536)


def _is_host(text: str) -> bool:
    """A host name or IP literal, not host:port (an IPv6 literal is the only host with colons)."""
    host = _unbracket(text)
    if not host or any(c.isspace() or c in "/@" for c in host):
        return False
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return False
    return True



_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _coerce(name: str, value: Any, kind: Any) -> Any:
    """Strings from env / TOML into the setting's type `kind`, with a clear error naming it."""
    kind = str(kind)
    try:
        if name == "peers":
            if isinstance(value, str):
                return [p.strip() for p in value.split(",") if p.strip()]
            return [str(p) for p in value]
        if name == "relays" and isinstance(value, (list, tuple)):  # TOML: relays = [1, 2]
            return ",".join(str(v) for v in value)
        if name in ("link_overrides", "relay_routes"):  # env: ";"-separated; TOML: a list, or a table {"0->1" = SPEC}
            if isinstance(value, str):
                return [e.strip() for e in value.split(";") if e.strip()]
            if isinstance(value, Mapping):
                return [f"{k}:{v}" for k, v in value.items()]
            if isinstance(value, (list, tuple)):
                return [str(e) for e in value]
            raise TypeError("not a list")
        if name == "auth_token" and isinstance(value, str):
            return value  # "" must fail validation, not silently mean "no token"
        if value is None or (isinstance(value, str) and value.lower() in ("", "none") and "None" in kind):
            return None
        if kind.startswith("bool"):
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
                return value.strip().lower() in _TRUE
            raise TypeError("not a boolean")
        if isinstance(value, bool) and kind.startswith(("int", "float")):
            raise TypeError("a boolean is not a number")  # int(True) would silently give 1
        if kind.startswith("int"):
            if isinstance(value, float) and not value.is_integer():
                raise ValueError("fractional value")  # int(1.5) would silently truncate
            return int(value)
        if kind.startswith("float"):
            return float(value)
        if kind.startswith("str"):
            return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"setting {name}={value!r} is not a valid {kind}") from None
    return value


def _from_toml(path: Path) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    if isinstance(data.get("node"), dict):  # allow a [node] table or top-level keys, not both
        outside = sorted(set(data) - {"node"})
        if outside:
            raise ConfigError(f"config file {path}: setting(s) {outside} outside the [node] table; "
                              "put every setting inside [node] (or use no table at all)")
        data = data["node"]
    unknown = sorted(set(data) - set(_FIELDS) - set(registry.all_options()))
    if unknown:
        raise ConfigError(f"config file {path}: {_unknown_settings(unknown)}")
    return data


_LAUNCHER_VARIABLES = {"world_size": ("WORLD_SIZE", "SLURM_NTASKS")}  # in the order _launcher_identity reads them


def _launcher_identity(env: Mapping[str, str]) -> dict[str, str]:
    """Rank, world size and run id as torchrun or Slurm set them (P2PTRAIN_* overrides them)."""
    values: dict[str, str] = {}
    if "RANK" in env:
        values["rank"] = env["RANK"]
    elif all(env.get(k, "").isdigit() for k in ("GROUP_RANK", "LOCAL_WORLD_SIZE", "LOCAL_RANK")):
        values["rank"] = str(int(env["GROUP_RANK"]) * int(env["LOCAL_WORLD_SIZE"]) + int(env["LOCAL_RANK"]))
    elif "SLURM_PROCID" in env:
        values["rank"] = env["SLURM_PROCID"]
    if "WORLD_SIZE" in env:
        values["world_size"] = env["WORLD_SIZE"]
    elif "SLURM_NTASKS" in env:
        values["world_size"] = env["SLURM_NTASKS"]
    if env.get("TORCHELASTIC_RUN_ID"):
        restarts = env.get("TORCHELASTIC_RESTART_COUNT", "0")
        # torchrun restarts every worker as a new round: a fresh rendezvous, never the last round's keys
        values["run_id"] = env["TORCHELASTIC_RUN_ID"] + (f"-restart{restarts}" if restarts not in ("", "0") else "")
    return values


def _rendezvous_from_launcher(values: dict[str, Any], env: Mapping[str, str], flags: Mapping[str, Any]) -> None:
    """A node given no peer list: the store at MASTER_ADDR:MASTER_PORT (torchrun's, Slurm scripts')
    unless one is named; the launcher's world size must then agree with --world-size; a rendezvous
    needs a world size."""
    if values.get("rendezvous") is None and env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        host = env["MASTER_ADDR"]
        values["rendezvous"] = f"[{host}]:{env['MASTER_PORT']}" if ":" in host else f"{host}:{env['MASTER_PORT']}"
    if values.get("rendezvous") is None:
        return
    if "world_size" not in values:
        raise ConfigError("a rendezvous needs the number of nodes: --world-size N (or WORLD_SIZE / SLURM_NTASKS "
                          "from torchrun / Slurm)")


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = dict(_launcher_identity(env))
    for name in [*_FIELDS, *registry.all_options()]:
        key = f"P2PTRAIN_{name.upper()}"
        if key in env:
            values[name] = env[key]
    return values
