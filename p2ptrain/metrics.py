"""Prometheus metrics of one node.

Observed by everyone (transport, algorithms, training loop), calls nobody back, imports nothing
from the project. Each node owns a private CollectorRegistry so several nodes can live in one
process (tests) without clashing, and serves it on its own /metrics port, at the address its
owner picks (NodeConfig.metrics_bind_host: the host of --listen unless --metrics-host is given,
since /metrics has no authentication).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

STEP_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def serve_registry(registry: CollectorRegistry, port: int, addr: str):
    """Serve `registry` on http://addr:port/metrics (0 picks a free port); returns (server, thread).
    A port already taken is a one-line error that names it, not a socketserver traceback."""
    try:
        return start_http_server(port, addr=addr, registry=registry)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot serve /metrics on {addr}:{port}: {exc.strerror or exc} "
                                 "(pick another --metrics-port, or 0 for any free one)") from None


def counter_total(registry: CollectorRegistry, sample: str) -> int:
    """A counter summed over its labels (e.g. what a node relayed, to every next hop)."""
    return int(sum(s.value for m in registry.collect() for s in m.samples if s.name == sample))


class NodeMetrics:
    """All p2ptrain_* series of one node; `node` is the rank as a label value."""

    def __init__(self, node: int | str, algorithm: str = "", registry: CollectorRegistry | None = None):
        self.node = str(node)
        self._peer_children: dict[tuple[int, int], object] = {}  # (id(family), peer) -> its labelled child
        self.algorithm = algorithm
        self.registry = registry or CollectorRegistry()
        r = self.registry
        peer = ["node", "peer"]
        self.sent_bytes = Counter("p2ptrain_sent_bytes", "Payload bytes sent to a peer", peer, registry=r)
        self.received_bytes = Counter("p2ptrain_received_bytes", "Payload bytes received from a peer",
                                      peer, registry=r)
        self.sent_messages = Counter("p2ptrain_sent_messages", "Tensor messages sent to a peer", peer,
                                     registry=r)
        self.received_messages = Counter("p2ptrain_received_messages",
                                         "Tensor messages accepted from a peer", peer, registry=r)
        self.send_errors = Counter("p2ptrain_send_errors", "Sends that failed (transport error or timeout)",
                                   peer, registry=r)
        self.refused_sends = Counter("p2ptrain_refused_sends",
                                     "Sends the receiving peer rejected (mass re-absorbed by SGP)",
                                     peer, registry=r)
        self.dropped_messages = Counter("p2ptrain_dropped_messages",
                                        "Messages to a peer lost by link emulation (every lost "
                                        "attempt of a reliable send counts)", peer, registry=r)
        self.lane_messages = Counter("p2ptrain_lane_messages",
                                     "Tensor messages a peer answered over its TCP lane (the others went by gRPC "
                                     "streaming)", peer, registry=r)
        self.rejected_messages = Counter("p2ptrain_rejected_messages",
                                         "Incoming messages rejected, by reason", ["node", "reason"],
                                         registry=r)
        self.step_seconds = Histogram("p2ptrain_step_seconds", "Wall seconds of one training step",
                                      ["node", "algorithm"], buckets=STEP_SECONDS_BUCKETS, registry=r)
        self.loss = Gauge("p2ptrain_loss", "Training loss of the latest step", ["node", "algorithm"],
                          registry=r)
        self.ps_weight = Gauge("p2ptrain_ps_weight", "Push-sum weight w of the node", ["node"], registry=r)
        self.step = Gauge("p2ptrain_step", "Current training step", ["node"], registry=r)
        # Faults and membership (issue 5)
        self.link_timeouts = Counter("p2ptrain_link_timeouts",
                                     "Waits for a peer's message that hit their deadline (the link counts as "
                                     "dropped for that step; a late message is folded in later)", peer,
                                     registry=r)
        self.peer_up = Gauge("p2ptrain_peer_up", "1 while this node considers the peer alive, else 0", peer,
                             registry=r)
        self.live_peers = Gauge("p2ptrain_live_peers", "Peers this node considers alive (itself excluded)",
                                ["node"], registry=r)
        self.peer_via = Gauge("p2ptrain_peer_via", "How this node's last delivered message reached the peer: -1 "
                              "directly, -2 down the reverse stream the (private) peer opened, else the rank of "
                              "the relay it went through", peer, registry=r)
        self.reachability = Gauge("p2ptrain_reachability", "Whether peers can dial this node at its address: "
                                  "0 unknown, 1 public, 2 private (behind NAT or a firewall)", ["node"], registry=r)
        self.membership_changes = Counter("p2ptrain_membership_changes",
                                          "Peers declared dead or seen alive again", ["node", "peer"],
                                          registry=r)
        self.state_transfers = Counter("p2ptrain_state_transfers",
                                       "Model states sent to (re)joining peers", peer, registry=r)
        self.forwarded_bytes = Counter("p2ptrain_forwarded_bytes",
                                       "Payload bytes this node relayed on to the next hop (peer)", peer,
                                       registry=r)
        self.forwarded_messages = Counter("p2ptrain_forwarded_messages",
                                          "Messages this node relayed on to the next hop (peer)", peer,
                                          registry=r)
        self.model_projection = Gauge("p2ptrain_model_projection",
                                      "Model projected on fixed random unit directions (the same on every "
                                      "node): stddev across nodes per direction estimates the consensus "
                                      "distance", ["node", "direction"], registry=r)
        self.rpc_calls = Counter("p2ptrain_rpc_calls", "gRPC calls this node made, by method (Hello: greetings, "
                                 "probes and views; Settle; PushTensor: tensors not sent over a lane)",
                                 ["node", "method"], registry=r)
        self.rpc_bytes = Counter("p2ptrain_rpc_bytes", "Bytes of the requests of those calls (a push: its payload)",
                                 ["node", "method"], registry=r)
        # Plain running totals: cheap to read for progress lines without walking the registry.
        self.rpc_totals: dict[str, list[int]] = {}  # method -> [calls, bytes] (the simulation reads them)
        self.messages_sent_total = 0
        self.bytes_sent_total = 0
        self.bytes_received_total = 0
        self.dropped_total = 0
        self.link_timeouts_total = 0

    # Transport observations -------------------------------------------------------------------
    def _of_peer(self, family, peer: int):
        """`family`'s child for (this node, `peer`), looked up once: labels() takes a lock and builds
        its key on every call, and every message pays for a few of these."""
        key = (id(family), peer)
        child = self._peer_children.get(key)
        if child is None:
            child = self._peer_children[key] = family.labels(self.node, str(peer))
        return child

    def on_sent(self, peer: int, nbytes: int) -> None:
        self._of_peer(self.sent_bytes, peer).inc(nbytes)
        self._of_peer(self.sent_messages, peer).inc()
        self.messages_sent_total += 1
        self.bytes_sent_total += nbytes

    def on_received(self, peer: int, nbytes: int) -> None:
        self._of_peer(self.received_bytes, peer).inc(nbytes)
        self._of_peer(self.received_messages, peer).inc()
        self.bytes_received_total += nbytes

    def on_rejected(self, reason: str) -> None:
        self.rejected_messages.labels(self.node, reason).inc()

    def on_peer_via(self, peer: int, via: int) -> None:
        """-1: `peer` was reached directly; else through relay `via`."""
        self.peer_via.labels(self.node, str(peer)).set(via)

    def on_reachability(self, reachability: int) -> None:
        """0 unknown, 1 public, 2 private (the proto's Reachability)."""
        self.reachability.labels(self.node).set(reachability)

    def on_rpc(self, method: str, nbytes: int) -> None:
        """A gRPC call of `method` ("Hello", "Settle", ...) with an `nbytes` request left this node."""
        self.rpc_calls.labels(self.node, method).inc()
        self.rpc_bytes.labels(self.node, method).inc(nbytes)
        totals = self.rpc_totals.setdefault(method, [0, 0])
        totals[0] += 1
        totals[1] += nbytes

    def on_lane_message(self, peer: int) -> None:
        self._of_peer(self.lane_messages, peer).inc()

    def on_send_error(self, peer: int) -> None:
        self.send_errors.labels(self.node, str(peer)).inc()

    def on_refused_send(self, peer: int) -> None:
        self.refused_sends.labels(self.node, str(peer)).inc()

    def on_dropped(self, peer: int) -> None:
        self.dropped_messages.labels(self.node, str(peer)).inc()
        self.dropped_total += 1

    # Training observations --------------------------------------------------------------------
    def set_loss(self, loss: float) -> None:
        self.loss.labels(self.node, self.algorithm).set(loss)

    def on_step(self, step: int, seconds: float, loss: float | None) -> None:
        self.step.labels(self.node).set(step)
        self.step_seconds.labels(self.node, self.algorithm).observe(seconds)
        if loss is not None:
            self.loss.labels(self.node, self.algorithm).set(loss)

    def set_ps_weight(self, weight: float) -> None:
        self.ps_weight.labels(self.node).set(weight)

    def set_model_projection(self, values) -> None:
        for direction, value in enumerate(values):
            self.model_projection.labels(self.node, str(direction)).set(float(value))

    # Faults, membership, relaying -------------------------------------------------------------
    def on_link_timeout(self, peer: int) -> None:
        self.link_timeouts.labels(self.node, str(peer)).inc()
        self.link_timeouts_total += 1

    def set_peer_up(self, peer: int, up: bool, live_peers: int) -> None:
        self.peer_up.labels(self.node, str(peer)).set(1 if up else 0)
        self.live_peers.labels(self.node).set(live_peers)

    def on_membership_change(self, peer: int) -> None:
        self.membership_changes.labels(self.node, str(peer)).inc()

    def on_state_transfer(self, peer: int) -> None:
        self.state_transfers.labels(self.node, str(peer)).inc()

    def on_forwarded(self, next_hop: int, nbytes: int) -> None:
        self.forwarded_bytes.labels(self.node, str(next_hop)).inc(nbytes)
        self.forwarded_messages.labels(self.node, str(next_hop)).inc()

    def serve(self, port: int, addr: str = "0.0.0.0"):
        """Serve /metrics on `port` (0 picks a free one); returns (server, thread)."""
        return serve_registry(self.registry, port, addr)


# Parameter server (GEM, seed 001) ------------------------------------------------------------------
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256)


class PsMetrics:
    """Series of the parameter server, labelled per worker: rate(p2ptrain_commits_total[1m]) is
    commits per second. Commits are applied on the server's event loop, so no locking is needed."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.commits = Counter("p2ptrain_commits", "Commits applied to the central variable", ["worker"],
                               registry=r)
        self.staleness = Histogram("p2ptrain_commit_staleness",
                                   "Staleness τ of applied commits: versions applied between the update's "
                                   "base version and the commit", ["worker"], buckets=STALENESS_BUCKETS,
                                   registry=r)
        self.pull_bytes = Counter("p2ptrain_pull_bytes", "Central-variable bytes sent to a worker by Pull",
                                  ["worker"], registry=r)
        self.commit_bytes = Counter("p2ptrain_commit_bytes", "Update bytes of applied commits", ["worker"],
                                    registry=r)
        self.rejected_commits = Counter("p2ptrain_rejected_commits",
                                        "Commits rejected or aborted (nothing applied), by reason", ["reason"],
                                        registry=r)
        self.version = Gauge("p2ptrain_ps_version", "Version of the central variable (commits applied)",
                             registry=r)
        self.workers_done = Gauge("p2ptrain_ps_workers_done", "Workers that said they are done", registry=r)

    def on_pull(self, worker: int, nbytes: int) -> None:
        self.pull_bytes.labels(str(worker)).inc(nbytes)

    def on_commit(self, worker: int, nbytes: int, staleness: int, version: int) -> None:
        self.commits.labels(str(worker)).inc()
        self.commit_bytes.labels(str(worker)).inc(nbytes)
        self.staleness.labels(str(worker)).observe(staleness)
        self.version.set(version)

    def on_rejected(self, reason: str) -> None:
        self.rejected_commits.labels(reason).inc()

    def on_done(self, workers_done: int) -> None:
        self.workers_done.set(workers_done)

    def serve(self, port: int, addr: str = "0.0.0.0"):
        return serve_registry(self.registry, port, addr)


class WorkerMetrics(NodeMetrics):
    """A parameter-server worker: NodeMetrics (commits count as sent to peer "ps", pulls as received
    from it) plus GEM's median scaling factor and the staleness the server reported."""

    def __init__(self, node: int | str, algorithm: str = "gem", registry: CollectorRegistry | None = None):
        super().__init__(node, algorithm, registry)
        r = self.registry
        self.pi_median = Gauge("p2ptrain_gem_pi_median",
                               "Median scaling factor π of the latest commit (1 for downpour, 1/(τ+1) for "
                               "adaptive staleness)", ["node", "algorithm"], registry=r)
        self.worker_staleness = Gauge("p2ptrain_worker_staleness",
                                      "Staleness τ of this worker's latest commit, as the server applied it",
                                      ["node"], registry=r)

    def on_commit(self, pi_median: float, staleness: int) -> None:
        self.pi_median.labels(self.node, self.algorithm).set(pi_median)
        self.worker_staleness.labels(self.node).set(staleness)
