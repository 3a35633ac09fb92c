"""NodeConfig: every setting of a node, as frozen groups (sections.py) plus the algorithm's options.

A setting's flat name is its identity: NodeConfig(steps=10), config.steps, config.replace(rank=3)
and the sources (flags, TOML, env) all use it, and NodeConfig resolves it to the one group that
holds it (config.training.steps). Code that needs a whole group takes it (the transport takes
config.transport). The algorithm's own options travel in `options` by name and are parsed by the
registry's dataclass (algorithm_options). validate() lets every group check itself, then checks
what spans groups, here and nowhere else. This module builds no transport object and imports no
torch (p2ptrain/node.py composes the node).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import operator
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

from p2ptrain.addresses import IPV4_WILDCARD, host_of, is_wildcard, unbracket
from p2ptrain.algorithms import registry
from p2ptrain.algorithms.registry import AlgorithmOptions, AlgorithmSpec
from p2ptrain.settings import sources
from p2ptrain.settings.parsers import SlowSchedule
from p2ptrain.settings.sections import (
    SECTIONS,
    SETTINGS,
    ClusterSettings,
    ConfigError,
    DataSettings,
    FaultSettings,
    OutputSettings,
    SecuritySettings,
    TrainingSettings,
    TransportSettings,
    need,
    parsed,
)
from p2ptrain.topology import max_peers_per_step

if TYPE_CHECKING:
    from p2ptrain.transport.faults import LinkTable

# Settings every node of a cluster must share (checked in Hello), besides the algorithm's own options
# that declare fingerprint=True.
FINGERPRINT_SETTINGS = ("world_size", "max_nodes", "algorithm", "resolved_topology", "model", "hidden", "dataset",
                        "seed", "dirichlet_alpha", "num_train")


@dataclass(frozen=True, init=False)
class NodeConfig:
    """Every setting of one node: its groups, the algorithm's options, and what the sources said."""

    cluster: ClusterSettings
    training: TrainingSettings
    data: DataSettings
    transport: TransportSettings
    faults: FaultSettings
    security: SecuritySettings
    output: OutputSettings
    options: dict[str, Any]  # the algorithm's own settings, by option name (its options dataclass)
    # Options of other algorithms that came from a shared TOML file or the environment (a cluster's
    # workers and peers may share one file): kept here, reported at start-up, never applied.
    ignored_options: dict[str, Any]
    # False when no source gave a rank: a rendezvous store then assigns one (rendezvous.assign_rank).
    rank_given: bool = field(compare=False, repr=False)

    def __init__(self, *, options: Mapping[str, Any] | None = None,
                 ignored_options: Mapping[str, Any] | None = None, rank_given: bool = True, **settings: Any):
        """NodeConfig(steps=10, algorithm="sgp", options={"overlap": 1}): settings by flat name
        (the others keep their defaults), or whole groups (training=TrainingSettings(...)), or both:
        flat names then apply on top of the group given."""
        changes: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
        for name, value in settings.items():
            if name in SETTINGS:
                changes[SETTINGS[name].section][name] = value
            elif name not in SECTIONS:
                raise TypeError(f"NodeConfig got an unknown setting {name!r}")
        for section, group in SECTIONS.items():
            value = settings.get(section) or group()
            object.__setattr__(self, section, dataclasses.replace(value, **changes[section]))
        object.__setattr__(self, "options", dict(options or {}))
        object.__setattr__(self, "ignored_options", dict(ignored_options or {}))
        object.__setattr__(self, "rank_given", rank_given)

    def replace(self, **changes: Any) -> "NodeConfig":
        """A copy with `changes` by flat setting name (rank=3, rank_given=True) or whole group."""
        kept = {name: getattr(self, name) for name in (*SECTIONS, "options", "ignored_options", "rank_given")}
        return type(self)(**{**kept, **changes})

    @classmethod
    def from_sources(cls, *, toml_path: str | os.PathLike | None = None, env: Mapping[str, str] | None = None,
                     flags: Mapping[str, Any] | None = None, spelled: Mapping[str, str] = {}) -> "NodeConfig":
        """defaults < TOML < environment < flags (None-valued flags mean 'not given'), validated;
        the rules are sources.gather's."""
        found = sources.gather(toml_path=toml_path, env=os.environ if env is None else env, flags=flags or {},
                               spelled=spelled)
        try:
            config = cls(**found.settings, options=found.options, ignored_options=found.ignored,
                         rank_given=found.rank_given)
        except (TypeError, ValueError) as exc:
            raise ConfigError(str(exc)) from None
        if not config.rank_given and config.tls_require_client_cert and config.tls_cert:
            config = config._rank_from_certificate()
        return config.validate()

    # -- derived values ---------------------------------------------------------------------------
    slots = property(lambda self: self.cluster.slots, doc=ClusterSettings.slots.__doc__)
    elastic = property(lambda self: self.cluster.elastic, doc=ClusterSettings.elastic.__doc__)
    uses_rendezvous = property(lambda self: self.cluster.uses_rendezvous, doc=ClusterSettings.uses_rendezvous.__doc__)
    resolved_topology = property(lambda self: self.training.resolved_topology)
    resolved_optimizer = property(lambda self: self.training.resolved_optimizer)
    learning_rate = property(lambda self: self.training.learning_rate)
    chunk_bytes = property(lambda self: self.transport.chunk_bytes)

    @property
    def algorithm_spec(self) -> AlgorithmSpec:
        return self.training.algorithm_spec

    @property
    def algorithm_options(self) -> AlgorithmOptions:
        """The algorithm's options dataclass, from `options` (validated against these settings)."""
        try:
            return self.algorithm_spec.parse_options(self.options, self)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{self.algorithm}: {exc}") from None

    @property
    def resolved_max_lag(self) -> int:
        """The lag limit: above what the algorithm's bounded delay can produce on any graph of this size."""
        if self.max_lag is not None:
            return self.max_lag
        delay = self.algorithm_options.bounded_delay()
        return max(1, min(self.step_window - 1, max(16, (delay + 1) * (self.world_size - 1) + 1)))

    @property
    def compute_slowdown(self) -> float:
        """This node's compute slow-down factor (>= 1) from `slowdown`."""
        factors = parsed(f"slowdown {self.slowdown!r}", self.faults.slowdown_plan().factors, self.world_size)
        return factors.get(self.rank, 1.0)

    @property
    def slowdown_schedule(self) -> "float | SlowSchedule":
        """This node's slow-down for the trainer: compute_slowdown, or, where slow windows name this
        rank, a step -> factor schedule (the plain factor keeps the step loop as it was)."""
        windows = self.faults.slow_plan()
        for window in windows:
            need(0 <= window.rank < self.slots,
                 f"compute slow-down: slow window of rank {window.rank}: rank outside 0..{self.slots - 1}")
        mine = tuple(w for w in windows if w.rank == self.rank)
        return SlowSchedule(self.compute_slowdown, mine) if mine else self.compute_slowdown

    @property
    def nan_injection_step(self) -> int | None:
        """The step at which this node's loss is made NaN (`inject_nan` = "RANK@STEP"), if it is this rank."""
        injection = self.faults.nan_injection()
        if injection is None:
            return None
        need(0 <= injection.number < self.world_size,
             f"inject_nan {self.inject_nan!r}: rank {injection.number} outside 0..{self.world_size - 1}")
        return injection.step if injection.number == self.rank else None

    @property
    def metrics_bind_host(self) -> str:
        """Where /metrics listens: metrics_host when given; else the host a node or parameter server
        binds its gRPC server to, so `--listen 127.0.0.1:P` keeps the unauthenticated metrics on
        loopback too; all interfaces (IPv4 only, which binds in every container) when that host is
        a wildcard or not given (the gRPC default [::]:port) and for workers, which serve no gRPC."""
        if self.metrics_host is not None:
            return unbracket(self.metrics_host)
        if self.role == "worker" or not self.listen:
            return IPV4_WILDCARD
        if self.listen.startswith("unix"):  # a Unix socket: only local callers reach the gRPC server
            return "127.0.0.1"
        host = host_of(self.listen)
        return IPV4_WILDCARD if is_wildcard(host) else host

    def link_table(self) -> "LinkTable | None":
        """The emulation of this node's outgoing links (seeded from `seed`), None when off: the one
        place that reads `link`, `link_overrides` and `link_bursts`."""
        if not self.link and not self.link_overrides and not self.link_bursts:
            return None
        from p2ptrain.transport.faults import LinkTable  # the spec grammar is the emulator's

        def table() -> LinkTable:
            links = LinkTable.parse(self.link, self.link_overrides, seed=self.seed, bursts=self.link_bursts)
            links.check_ranks(self.slots)
            return links

        return parsed("link emulation", table)

    # -- validation -------------------------------------------------------------------------------
    def validate(self) -> "NodeConfig":
        """Every group checks its own settings, then what spans groups; ConfigError says which."""
        for section in SECTIONS:
            getattr(self, section).validate()
        self._validate_algorithm()
        need(self.role == "peer" or self.momentum < 1,
             f"momentum μ must be < 1 for a parameter-server worker, got {self.momentum}")
        _ = (self.slowdown_schedule, self.nan_injection_step)  # the ranks they name are in the run
        self.transport.relay_plan(self.world_size)
        self.link_table()
        if self.role in ("peer", "ps"):  # these serve: TLS needs their own certificate
            need(not self.tls_ca or bool(self.tls_cert),
                 f"a TLS {'parameter server' if self.role == 'ps' else 'node'} needs --tls-cert and --tls-key "
                 "besides --tls-ca")
        if self.tls_require_client_cert and self.tls_cert:
            self._validate_identity()
        return self

    def _rank_from_certificate(self) -> "NodeConfig":
        """No source gave a rank (a rendezvous would hand one out): under mutual TLS, a certificate
        that names a node rank (`p2ptrain pki issue`) gives it, so that the rank is the certified one."""
        from p2ptrain.transport.peer_identity import certified_identity  # reads the certificate
        from p2ptrain.transport.security import security_from_settings

        try:
            identity = certified_identity(security_from_settings(self.security))
        except ValueError:  # SecurityError, an unreadable file: validate() says what is wrong
            return self
        if identity is None or identity.rank is None or self.role == "ps":
            return self
        return self.replace(rank=identity.rank, rank_given=True)

    def _validate_identity(self) -> None:
        """Mutual TLS: a certificate that names a p2ptrain node (`p2ptrain pki issue`) must name this
        one (its rank, or "ps"), of this run (run_id)."""
        from p2ptrain.transport.peer_identity import own_identity  # reads the certificate
        from p2ptrain.transport.security import security_from_settings

        try:
            own_identity(security_from_settings(self.security), "ps" if self.role == "ps" else self.rank, self.run_id)
        except ValueError as exc:  # SecurityError
            raise ConfigError(str(exc)) from None

    def _validate_algorithm(self) -> None:
        spec = self.algorithm_spec
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

    # -- what the cluster shares, and reports -----------------------------------------------------
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
        values: dict[str, Any] = {}
        for section in SECTIONS:
            values.update(dataclasses.asdict(getattr(self, section)))
        if self.ignored_options:
            values["ignored_options"] = dict(self.ignored_options)
        values.update(dataclasses.asdict(self.algorithm_options))
        if values.get("auth_token") is not None:
            values["auth_token"] = "<redacted>"
        return values


def _read_flat(config: type) -> None:
    """config.steps reads config.training.steps: one property per setting, none hiding another name."""
    for setting in SETTINGS.values():
        if hasattr(config, setting.name):
            raise TypeError(f"setting {setting.name!r} would hide {config.__name__}.{setting.name}")
        path = f"{setting.section}.{setting.name}"
        setattr(config, setting.name, property(operator.attrgetter(path), doc=path))


_read_flat(NodeConfig)

__all__ = ["FINGERPRINT_SETTINGS", "NodeConfig"]
