"""NodeConfig: every setting of a node, from defaults < TOML file < environment < command-line flags.

Environment: torchrun's RANK / WORLD_SIZE, and P2PTRAIN_<FIELD> for any field (e.g.
P2PTRAIN_PEERS="node0:50051,node1:50051", P2PTRAIN_OVERLAP=1), which is what docker-compose uses.
List settings in one string: peers comma-separated, link_overrides semicolon-separated.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import ipaddress
import json
import os
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from p2ptrain.algorithms import ALGORITHM_NAMES, ALGORITHM_TOPOLOGIES, default_topology
from p2ptrain.algorithms.allreduce import AVERAGE_WHAT
from p2ptrain.algorithms.gem import DEFAULT_CLAMP as GEM_DEFAULT_CLAMP
from p2ptrain.algorithms.gem import DEFAULT_EPSILON as GEM_DEFAULT_EPSILON
from p2ptrain.algorithms.gem import FLOAT32_TINY
from p2ptrain.algorithms.gem import POLICIES as GEM_POLICIES
from p2ptrain.algorithms.gem import parse_clamp
from p2ptrain.compression import CODECS
from p2ptrain.topology import TOPOLOGY_NAMES

if TYPE_CHECKING:
    from p2ptrain.transport.faults import LinkTable

# Peer algorithms, plus gem: asynchronous workers around a parameter server (p2ptrain.ps), which
# `launch` runs as one `p2ptrain ps` process and --nodes `--role worker` processes.
ALGORITHMS = (*ALGORITHM_NAMES, "gem")
ROLES = ("peer", "ps", "worker")  # peer: decentralized node; ps / worker: parameter server (GEM, seed 001)
PS_POLICIES = GEM_POLICIES
MODELS = ("mlp", "cnn")
DATASETS = ("synthetic", "mnist")
DEVICES = ("auto", "cpu", "cuda")
# Learning rates measured to train each built-in model well with momentum 0.9 (the CNN diverges
# towards ~60% accuracy at 0.05 on the synthetic task, reaches ~93% at 0.01).
DEFAULT_LR = {"mlp": 0.05, "cnn": 0.01}
# /metrics on every interface: IPv4 only, which binds in every container (IPv6 may be disabled there).
ALL_INTERFACES = "0.0.0.0"
_WILDCARD_HOSTS = ("", "0.0.0.0", "::", "*")


class ConfigError(ValueError):
    """A setting that is missing, malformed or inconsistent; the message says which and why."""


@dataclass
class NodeConfig:
    # Identity and cluster
    rank: int = 0
    world_size: int = 1
    peers: list[str] = field(default_factory=list)  # address of every node, indexed by rank
    listen: str | None = None                        # bind address (default: [::]:<own peer port>)
    # Algorithm
    algorithm: str = "sgp"
    topology: str | None = None                      # None: the algorithm's default (see ALGORITHM_TOPOLOGIES)
    peers_per_step: int = 1
    overlap: int = 0                                 # τ: bounded delay of SGP messages, in steps
    average: str = "models"                          # allreduce: average models or gradients
    compression: str = "none"                        # allreduce / pipesgd: codec of every ring hop
    warmup_steps: int = 0                            # pipesgd: synchronous steps before pipelining
    # Parameter server (GEM, seed 001): world_size = number of workers, rank = worker id
    role: str = "peer"                               # peer | ps | worker
    ps_address: str | None = None                    # host:port of the parameter server
    ps_policy: str = "gem"                           # worker rule: gem | downpour | adaptive-staleness | proxy
    gem_kappa: float = 1.0                           # κ: proxy energy amplification (App. B, eq. 27)
    gem_epsilon: float = GEM_DEFAULT_EPSILON         # ε of π's denominator (Algorithm 1)
    gem_clamp: str | None = GEM_DEFAULT_CLAMP        # "lo,hi": clamp π to [lo, hi]; None = unclamped
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
    lr: float | None = None                          # None: the model's default (DEFAULT_LR)
    momentum: float = 0.9
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
    # Observability and output
    metrics_port: int | None = None                  # serve Prometheus /metrics here (0 = any free port)
    metrics_host: str | None = None                  # bind /metrics here; None: the host of listen (see
                                                     # metrics_bind_host); not in the fingerprint
    log_every: int = 10
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

    # -- validation -------------------------------------------------------------------------------
    def validate(self) -> "NodeConfig":
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(msg)

        need(self.world_size >= 1, f"world_size must be >= 1, got {self.world_size}")
        need(0 <= self.rank < self.world_size, f"rank {self.rank} outside 0..{self.world_size - 1}")
        need(self.role in ROLES, f"unknown role {self.role!r}; choose from {ROLES}")
        if self.role == "peer" and (self.world_size > 1 or self.peers):
            need(len(self.peers) == self.world_size,
                 f"--peers lists {len(self.peers)} addresses but world size is {self.world_size}: "
                 "give one host:port per node, in rank order")
            for addr in self.peers:
                host, sep, port = addr.rpartition(":")
                need(bool(sep and host and port.isdigit() and 0 < int(port) < 65536),
                     f"peer address {addr!r} is not host:port")
            need(len(set(self.peers)) == len(self.peers), "peer addresses must be distinct")
        self._validate_ps(need)
        need(self.algorithm in ALGORITHMS, f"unknown algorithm {self.algorithm!r}; choose from {ALGORITHMS}")
        need(self.topology is None or self.topology in TOPOLOGY_NAMES,
             f"unknown topology {self.topology!r}; choose from {TOPOLOGY_NAMES}")
        if self.algorithm == "gem":
            need(self.role != "peer", "--algorithm gem runs as a parameter server (p2ptrain ps) and workers "
                                      "(--role worker), or through p2ptrain launch")
        elif self.algorithm in ALGORITHMS:
            allowed = ALGORITHM_TOPOLOGIES[self.algorithm]
            need(self.resolved_topology in allowed,
                 f"{self.algorithm} cannot run on topology {self.topology!r}; choose from {allowed}")
        need(self.average in AVERAGE_WHAT, f"unknown average {self.average!r}; choose from {AVERAGE_WHAT}")
        need(self.compression in CODECS, f"unknown compression {self.compression!r}; choose from {tuple(CODECS)}")
        need(self.warmup_steps >= 0, f"warmup_steps must be >= 0, got {self.warmup_steps}")
        need(self.peers_per_step >= 1, "peers_per_step must be >= 1")
        need(self.overlap >= 0, f"overlap τ must be >= 0, got {self.overlap}")
        need(self.overlap < self.step_window, "overlap τ must be smaller than step_window")
        need(self.steps >= 1, "steps must be >= 1")
        need(self.model in MODELS, f"unknown model {self.model!r}; choose from {MODELS}")
        need(self.dataset in DATASETS, f"unknown dataset {self.dataset!r}; choose from {DATASETS}")
        need(self.dataset != "mnist" or bool(self.data_dir), "--dataset mnist needs --data-dir with IDX files")
        need(self.dirichlet_alpha is None or (0 < self.dirichlet_alpha < float("inf")),
             f"dirichlet_alpha must be a positive finite number, got {self.dirichlet_alpha}")
        need(self.batch_size >= 1, "batch_size must be >= 1")
        need((self.lr is None or self.lr >= 0) and self.momentum >= 0 and self.weight_decay >= 0, "lr, momentum, weight_decay must be >= 0")
        need(self.device in DEVICES, f"unknown device {self.device!r}; choose from {DEVICES}")
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
        need(self.metrics_port is None or 0 <= self.metrics_port < 65536, "metrics_port must be a port number")
        need(self.metrics_host is None or _is_host(self.metrics_host),
             f"metrics_host {self.metrics_host!r} is not a host name or IP address (the port is metrics_port)")
        try:
            self.link_table()
        except ValueError as exc:
            raise ConfigError(f"link emulation: {exc}") from None
        self._validate_relays(need)
        self._validate_security(need)
        return self

    def _validate_relays(self, need) -> None:
        need(0 < self.relay_retry_after < float("inf"), f"relay_retry_after must be > 0 seconds, got "
                                                          f"{self.relay_retry_after}")
        if not self.relay_routes and self.relays is None:
            return
        from p2ptrain.transport.relay import parse_relay_routes, parse_relays  # imports grpc and torch

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
        try:
            self.security()
        except ValueError as exc:  # SecurityError: an empty token, a token file that is not text, ...
            raise ConfigError(str(exc)) from None

    def security(self):
        """The transport's Security (TLS files, token) of these settings; plaintext when none is set."""
        from p2ptrain.transport.security import PLAINTEXT, Security, read_token_file

        token = read_token_file(self.auth_token_file) if self.auth_token_file else self.auth_token
        if token is None and not (self.tls_cert or self.tls_ca):
            return PLAINTEXT
        return Security(tls_cert=self.tls_cert, tls_key=self.tls_key, tls_ca=self.tls_ca,
                        tls_server_name=self.tls_server_name, token=token,
                        require_client_cert=self.tls_require_client_cert)

    def _validate_ps(self, need) -> None:
        need(self.ps_policy in PS_POLICIES, f"unknown ps_policy {self.ps_policy!r}; choose from {PS_POLICIES}")
        if self.ps_address is not None:
            host, sep, port = self.ps_address.rpartition(":")
            need(bool(sep and host and port.isdigit() and 0 < int(port) < 65536),
                 f"ps_address {self.ps_address!r} is not host:port")
        if self.role == "worker" and self.ps_policy != "proxy":
            need(self.ps_address is not None, "a worker needs --ps-address HOST:PORT of the parameter server")
        if self.role == "ps":
            need(bool(self.listen or self.ps_address), "the parameter server needs --listen or --ps-address")
            need(self.ps_policy != "proxy", "--ps-policy proxy trains on one worker process without a parameter "
                                            "server; run it with --role worker")
        if self.ps_policy == "proxy" and self.role == "worker":
            need(self.world_size == 1, "--ps-policy proxy is synchronous momentum SGD on one process: use "
                                       "--world-size 1 (its batch is --batch-size)")
        need(self.gem_kappa >= 0 and self.gem_kappa < float("inf"),
             f"gem_kappa must be a finite number >= 0, got {self.gem_kappa}")
        need(FLOAT32_TINY <= self.gem_epsilon < float("inf"),
             f"gem_epsilon must be a normal float32 > 0 (>= {FLOAT32_TINY:.3g}), got {self.gem_epsilon}")
        need(self.role == "peer" or self.momentum < 1,
             f"momentum μ must be < 1 for a parameter-server worker, got {self.momentum}")
        try:
            parse_clamp(self.gem_clamp)
        except ValueError as exc:
            raise ConfigError(f"gem_clamp: {exc}") from None

    def link_table(self) -> "LinkTable | None":
        """The emulation of this node's outgoing links (seeded from `seed`); None when off."""
        if not self.link and not self.link_overrides:
            return None
        from p2ptrain.transport.faults import LinkTable  # the transport package imports grpc and torch

        table = LinkTable.parse(self.link, self.link_overrides, seed=self.seed)
        table.check_ranks(self.world_size)
        return table

    @property
    def resolved_topology(self) -> str:
        if self.algorithm not in ALGORITHM_TOPOLOGIES:  # gem: a star around the parameter server
            return self.topology or "star"
        return self.topology or default_topology(self.algorithm)

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
        """The lag limit: above what a bounded delay τ can produce on any graph of this size."""
        if self.max_lag is not None:
            return self.max_lag
        return max(1, min(self.step_window - 1, max(16, (self.overlap + 1) * (self.world_size - 1) + 1)))

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
    def learning_rate(self) -> float:
        return self.lr if self.lr is not None else DEFAULT_LR[self.model]

    @property
    def chunk_bytes(self) -> int:
        return int(self.chunk_mb * 1024 * 1024)

    def fingerprint(self) -> str:
        """Hash of the settings every node of a cluster must share (checked in Hello)."""
        shared = {k: getattr(self, k) for k in ("world_size", "algorithm", "resolved_topology", "peers_per_step",
                                                 "overlap", "average", "compression", "warmup_steps", "model",
                                                 "hidden", "dataset", "seed", "dirichlet_alpha", "num_train")}
        return hashlib.sha256(json.dumps(shared, sort_keys=True).encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        """Every setting, for reports and logs: the auth token is redacted."""
        values = dataclasses.asdict(self)
        if values.get("auth_token") is not None:
            values["auth_token"] = "<redacted>"
        return values

    # -- sources ----------------------------------------------------------------------------------
    @classmethod
    def from_sources(cls, *, toml_path: str | os.PathLike | None = None, env: Mapping[str, str] | None = None,
                     flags: Mapping[str, Any] | None = None) -> "NodeConfig":
        """defaults < TOML < environment < flags (None-valued flags mean 'not given')."""
        values: dict[str, Any] = {}
        if toml_path:
            values.update(_from_toml(Path(toml_path)))
        values.update(_from_env(os.environ if env is None else env))
        values.update({k: v for k, v in (flags or {}).items() if v is not None and k in _FIELDS})
        try:
            config = cls(**{k: _coerce(k, v) for k, v in values.items()})
        except (TypeError, ValueError) as exc:
            raise ConfigError(str(exc)) from None
        return config.validate()


_FIELDS = {f.name: f for f in fields(NodeConfig)}


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


def _coerce(name: str, value: Any) -> Any:
    """Strings from env / TOML into the field's type, with a clear error naming the field."""
    kind = str(_FIELDS[name].type)
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
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise ConfigError(f"config file {path}: unknown setting(s) {unknown}; valid: {sorted(_FIELDS)}")
    return data


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    if "WORLD_SIZE" in env:
        values["world_size"] = env["WORLD_SIZE"]
    if "RANK" in env:
        values["rank"] = env["RANK"]
    for name in _FIELDS:
        key = f"P2PTRAIN_{name.upper()}"
        if key in env:
            values[name] = env[key]
    return values


def add_node_arguments(parser: argparse.ArgumentParser, *, cluster_flags: bool = True) -> None:
    """The node's flags; defaults are None so that unspecified flags do not override TOML/env."""
    d = NodeConfig()
    g = parser.add_argument_group("cluster")
    if cluster_flags:
        g.add_argument("--rank", type=int, help="this node's rank (env RANK)")
        g.add_argument("--world-size", type=int, help="number of nodes (env WORLD_SIZE)")
        g.add_argument("--peers", help="comma-separated host:port of every node in rank order")
        g.add_argument("--listen", help="bind address, default [::]:<own port from --peers>")
    g = parser.add_argument_group("algorithm")
    g.add_argument("--algorithm", choices=ALGORITHMS, help=f"training algorithm (default {d.algorithm})")
    g.add_argument("--topology", choices=TOPOLOGY_NAMES,
                   help="communication graph; default per algorithm: " + ", ".join(
                       f"{a} {t[0]}" for a, t in ALGORITHM_TOPOLOGIES.items()))
    g.add_argument("--peers-per-step", type=int,
                   help=f"out-peers per step (exponential), max out-degree (random) (default {d.peers_per_step})")
    g.add_argument("--overlap", type=int, metavar="TAU",
                   help=f"bounded delay τ: step-k messages are mixed in by step k+τ; 0 = synchronous (default {d.overlap})")
    g.add_argument("--average", choices=AVERAGE_WHAT,
                   help=f"allreduce: average models after the step or gradients before it (default {d.average})")
    g.add_argument("--compression", choices=tuple(CODECS),
                   help="allreduce/pipesgd: codec of every ring hop: fp16 = 16-bit truncation, int8 = 8-bit "
                        f"scalar quantization (default {d.compression})")
    g.add_argument("--warmup-steps", type=int,
                   help=f"pipesgd: synchronous all-reduce steps before pipelining (default {d.warmup_steps})")
    g = parser.add_argument_group("parameter server (GEM, seed 001)")
    if cluster_flags:
        g.add_argument("--role", choices=ROLES,
                       help="peer: decentralized node; ps: parameter server for --world-size workers (same as "
                            "`p2ptrain ps`); worker: asynchronous worker --rank of the server at --ps-address "
                            f"(default {d.role})")
        g.add_argument("--ps-address", "--ps", dest="ps_address", metavar="HOST:PORT",
                       help="the parameter server (workers connect to it; the server listens on its port "
                            "unless --listen is given)")
    g.add_argument("--ps-policy", choices=PS_POLICIES,
                   help="worker rule: gem = scale updates by π (Alg. 1), downpour = π 1, adaptive-staleness = "
                        "the server applies Δθ/(τ+1), proxy = the target: momentum SGD (--lr, --momentum) on "
                        f"one process, no server (default {d.ps_policy})")
    g.add_argument("--gem-kappa", type=float, metavar="KAPPA",
                   help=f"κ: amplifies the proxy energy, π = (κ|m| - |θ-s|)/(|Δθ|+ε) (default {d.gem_kappa}); "
                        "GEM's μ is --momentum")
    g.add_argument("--gem-epsilon", type=float, metavar="EPS",
                   help=f"ε in π's denominator; only acts where Δθ is ~0 (default {d.gem_epsilon:g})")
    g.add_argument("--gem-clamp", metavar="LO,HI",
                   help="clamp π element-wise to [LO, HI]; 'none' = the paper's unclamped formula, whose negative "
                        f"π amplify the drift and diverge with several workers (default {d.gem_clamp}, as the "
                        "authors' code)")
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
    g.add_argument("--lr", type=float,
                   help="learning rate (default per model: " + ", ".join(f"{m} {v}" for m, v in DEFAULT_LR.items()) + ")")
    g.add_argument("--momentum", type=float,
                   help=f"SGD momentum; for ps workers GEM's μ and the proxy's momentum (default {d.momentum})")
    g.add_argument("--weight-decay", type=float, help=f"SGD weight decay (default {d.weight_decay})")
    g.add_argument("--seed", type=int, help=f"seed of model init, data and shards (default {d.seed})")
    g.add_argument("--device", choices=DEVICES, help="auto = cuda when available, else cpu (default auto)")
    g.add_argument("--threads", type=int, help=f"torch threads per node process (default {d.threads})")
    g = parser.add_argument_group("transport")
    g.add_argument("--chunk-mb", type=float, help=f"stream chunk size in MiB (default {d.chunk_mb})")
    g.add_argument("--peer-timeout", type=float, help=f"seconds to wait for a peer's message (default {d.peer_timeout})")
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
    if cluster_flags:
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
    g.add_argument("--config", dest="config_file", help="TOML file with settings (flags and env override it)")


class _JoinAppend(argparse.Action):
    """A repeatable flag kept as one ";"-joined string (the env form), so that `p2ptrain launch`
    can pass it on to its node processes as a single flag."""

    def __call__(self, parser, namespace, values, option_string=None):
        previous = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, f"{previous};{values}" if previous else values)


def flags_from_args(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if k in _FIELDS}
