"""Which way a node sends to each peer: relay routes declared in the config, relay candidates, and
direct links found down (paths/router.py sends, forwarding.py forwards).

Plain data and parsing: nothing here opens a connection or waits.
"""
from __future__ import annotations

import re
import time
from collections.abc import Iterable, Mapping
from typing import Callable

DEFAULT_RETRY_AFTER = 30.0
# Ack.reason of a relay that could not reach its next hop: nothing was delivered, so the sender
# may try another relay (same message id) or, having none, treat it as a definite refusal.
RELAY_UNREACHABLE = "relay_unreachable"

_ROUTE = re.compile(r"^\s*(\d+)\s*(<->|->)\s*(\d+)\s*$")


# -- configuration --------------------------------------------------------------------------------
def parse_relay_routes(entries: Iterable[str] | Mapping[str, str], world_size: int | None = None
                       ) -> dict[tuple[int, int], tuple[int, ...]]:
    """``SRC->DST:VIA[,VIA2...]`` (one direction) or ``SRC<->DST:VIA[,...]`` (both; the way back
    goes through the relays in reverse order), or a mapping ``{"SRC->DST": "VIA,..."}`` (TOML).
    Later entries for the same (SRC, DST) replace earlier ones. Raises ValueError."""
    items = [f"{k}:{v}" for k, v in entries.items()] if isinstance(entries, Mapping) else list(entries)
    routes: dict[tuple[int, int], tuple[int, ...]] = {}
    for entry in items:
        link, sep, via_text = str(entry).partition(":")
        match = _ROUTE.match(link)
        if not sep or not match:
            raise ValueError(f"relay route {entry!r} is not SRC->DST:VIA[,VIA2] or SRC<->DST:VIA "
                             "(e.g. 0->3:1)")
        src, arrow, dst = int(match.group(1)), match.group(2), int(match.group(3))
        try:
            via = tuple(int(v) for v in via_text.split(","))
        except ValueError:
            raise ValueError(f"relay route {entry!r}: relays must be comma-separated ranks") from None
        nodes = (src, dst, *via)
        if world_size is not None and not all(0 <= n < world_size for n in nodes):
            raise ValueError(f"relay route {entry!r} names a rank outside 0..{world_size - 1}")
        if len(set(nodes)) != len(nodes):
            raise ValueError(f"relay route {entry!r} visits a node twice (a loop, or a relay that is "
                             "the sender or receiver)")
        routes[(src, dst)] = via
        if arrow == "<->":
            routes[(dst, src)] = via[::-1]
    return routes


def parse_relays(text: str | Iterable | None, world_size: int | None = None) -> tuple[int, ...] | None:
    """Relay candidates for found-out routes: ``None`` / "" = detection off, ``"any"`` = any peer
    this node reached directly, ``"1,2"`` = these first (then any reached peer). Raises ValueError."""
    if text is None:
        return None
    parts = [str(p).strip() for p in (text.split(",") if isinstance(text, str) else text)]
    parts = [p for p in parts if p]
    if not parts:
        return None
    if parts == ["any"]:
        return ()
    try:
        ranks = tuple(int(p) for p in parts)
    except ValueError:
        raise ValueError(f"relays {text!r}: give comma-separated ranks, or 'any'") from None
    if world_size is not None and not all(0 <= r < world_size for r in ranks):
        raise ValueError(f"relays {text!r} names a rank outside 0..{world_size - 1}")
    return tuple(dict.fromkeys(ranks))


# -- routing ----------------------------------------------------------------------------------------
class RouteTable:
    """Which way this node sends to each peer.

    Declared routes always apply. Otherwise a peer is sent to directly until a direct send finds it
    unreachable; then its direct link is marked down for `retry_after` seconds (so a healed link is
    used again) and messages go through a relay candidate: the configured `relays` first, then
    peers this node reached directly. `detect` (relays configured) also makes the direct attempt
    fail fast on a refused connect instead of waiting for the peer to come up.
    """

    def __init__(self, rank: int, world_size: int, routes: Mapping[tuple[int, int], tuple[int, ...]] = (),
                 relays: tuple[int, ...] | None = None, *, retry_after: float = DEFAULT_RETRY_AFTER,
                 blocked: Callable[[int], bool] = lambda peer: False,
                 clock: Callable[[], float] = time.monotonic):
        self.rank = rank
        self.world_size = world_size
        self.routes = {dst: via for (src, dst), via in dict(routes).items() if src == rank}
        self.relays = relays
        self.retry_after = retry_after
        self.blocked = blocked  # emulated link down (known from the config, before any attempt)
        self.clock = clock
        self._down_until: dict[int, float] = {}
        self._reached: set[int] = set()
        self._via: dict[int, int] = {}  # peer -> relay that last delivered to it

    @property
    def detect(self) -> bool:
        return self.relays is not None

    def declared(self, peer: int) -> tuple[int, ...] | None:
        return self.routes.get(peer)

    def skip_hello(self, peer: int) -> bool:
        """Peers not to greet directly at start-up: declared routed, or behind a blocked link."""
        return peer in self.routes or self.blocked(peer)

    def direct_ok(self, peer: int) -> bool:
        until = self._down_until.get(peer)
        if until is not None and self.clock() >= until:
            del self._down_until[peer]  # retry the direct link: it may have healed
            until = None
        return until is None

    def mark_unreachable(self, peer: int) -> None:
        self._down_until[peer] = self.clock() + self.retry_after
        self._reached.discard(peer)

    def mark_reached(self, peer: int) -> None:
        self._down_until.pop(peer, None)
        self._reached.add(peer)

    def remember_via(self, peer: int, relay: int) -> None:
        self._via[peer] = relay

    def candidates(self, peer: int) -> list[int]:
        """Relays to try for `peer`, best first: the one that worked last, the configured ones,
        then peers reached directly; never the peer itself, us, or a relay whose link is down."""
        order = [self._via[peer]] if peer in self._via else []
        order += list(self.relays or ())
        order += sorted(self._reached)
        return [r for r in dict.fromkeys(order)
                if r not in (peer, self.rank) and self.direct_ok(r) and not self.blocked(r)]


__all__ = ["RouteTable", "parse_relay_routes", "parse_relays", "DEFAULT_RETRY_AFTER", "RELAY_UNREACHABLE"]
