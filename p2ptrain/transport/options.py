"""TransportOptions: how a node's transport is tuned (chunking, timeouts, windows, WAN emulation,
security, relaying), and the gRPC channel / server options that follow from them; from_settings
builds them from a node's transport settings (p2ptrain/settings/sections.py).

Plain settings data: nothing here opens a socket or starts a thread.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from p2ptrain.choices import DataPlane, Meet, Reachability
from p2ptrain.transport.faults import LinkTable
from p2ptrain.transport.framing import DEFAULT_CHUNK_BYTES
from p2ptrain.transport.membership.liveness import DEFAULT_MAX_LAG
from p2ptrain.transport.membership.views import DEFAULT_VIEW_MARGIN
from p2ptrain.transport.security import PLAINTEXT, Security

if TYPE_CHECKING:
    from p2ptrain.settings.sections import TransportSettings


@dataclass(frozen=True)
class TransportOptions:
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    send_timeout: float = 120.0        # one tensor push, including waiting for the peer to come up
    keepalive_ms: int = 20_000
    step_window: int = 64              # accept messages whose step is within ± this of ours
    shutdown_grace: float = 2.0
    pin_memory: bool = False           # receive buffers in pinned memory (CUDA training)
    links: LinkTable | None = None     # WAN emulation of outgoing links (faults.py); None = off
    link_deadline: float = 10.0        # longest wait for a peer's message of one step: then the link
                                       # counts as dropped for that step (late messages are folded in later)
    probe_timeout: float = 2.0         # a peer that misses a deadline and does not answer a Hello
                                       # within this is declared dead
    security: Security = PLAINTEXT     # TLS and auth token of server and channels (security.py)
    relay_routes: tuple[str, ...] = ()  # "SRC->DST:VIA[,VIA2]": peers reached through relays (routes.py)
    relays: str | None = None          # relay candidates ("1,2" / "any") when a peer proves unreachable
    relay_retry_after: float = 30.0    # seconds before a direct link found unreachable is tried again
    max_lag: int = DEFAULT_MAX_LAG     # a peer this many steps behind is not sent to / waited for; a node
                                       # this far behind the cluster catches up by a state transfer
    settle_interval: float = 1.0       # how often the fate of unacknowledged messages is asked for
    data_plane: DataPlane = "auto"     # tensor payloads over the peers' TCP lanes (auto: where offered),
                                       # or gRPC streaming only (paths/router.py)
    lane_port: int = 0                 # the TCP lane's port, on the gRPC listen host (0: one the OS picks)
    shared_memory: bool = True         # lane payloads between processes of one host through shared memory
                                       # (shared_segment.py), not the TCP stack; never under TLS
    reachability: Reachability = "auto"  # can peers dial this node: auto = ask them (reachability.py)
    initial_members: int | None = None  # elastic runs: ranks below this start as members, the others join
                                       # later (None: every rank of the world is a member from the start)
    view_margin: int = DEFAULT_VIEW_MARGIN  # steps between a membership change's proposal and its switch
    view_notice: float = 0.0           # ... and at least this many seconds at the proposer's pace (node.py: 1 s)
    meet: Meet = "everyone"            # at start, greet and wait for every peer, or only the neighbours the
                                       # algorithm names in Comm.ready() (large clusters: O(degree), not O(n))

    def __post_init__(self) -> None:
        object.__setattr__(self, "relay_routes", tuple(self.relay_routes))

    @classmethod
    def from_settings(cls, transport: "TransportSettings", **node: Any) -> "TransportOptions":
        """The options of a node's transport settings: a setting and an option of the same name are
        one knob (a setting left None keeps the option's default); chunk_mb and peer_timeout arrive
        as chunk_bytes and send_timeout. `node` adds what the node derives or builds itself (links,
        security, pinned memory, the resolved max_lag, the elastic membership) and wins."""
        names = {f.name for f in dataclasses.fields(cls)}
        same = {f.name: getattr(transport, f.name) for f in dataclasses.fields(transport)
                if f.name in names and getattr(transport, f.name) is not None}
        return cls(**{**same, "chunk_bytes": transport.chunk_bytes, "send_timeout": transport.peer_timeout, **node})

    def channel_options(self) -> list[tuple[str, object]]:
        limit = self.chunk_bytes + (1 << 20)  # a data chunk plus framing; headers are tiny
        return [
            ("grpc.max_send_message_length", limit),
            ("grpc.max_receive_message_length", limit),
            ("grpc.keepalive_time_ms", self.keepalive_ms),
            ("grpc.keepalive_timeout_ms", max(1000, self.keepalive_ms // 2)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            # A peer that was down (crash, restart) must be reachable again within a second, not
            # after gRPC's default reconnect backoff of up to 2 minutes.
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]  # flow-control / frame-size knobs measured no better (benchmarks/grpc_study.py)

    def server_options(self) -> list[tuple[str, object]]:
        return self.channel_options() + [
            ("grpc.http2.min_ping_interval_without_data_ms", max(1000, self.keepalive_ms // 2)),
            ("grpc.so_reuseport", 0),
        ]


__all__ = ["TransportOptions", "DataPlane"]
