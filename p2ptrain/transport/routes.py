"""Which way a node sends to each peer: relay routes declared in the config, relay candidates, and
direct links found down (paths/router.py sends, forwarding.py forwards; the settings' route and
relay texts are parsed by p2ptrain/settings/parsers.py).

Plain data: nothing here opens a connection or waits.
"""
from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Mapping
from typing import Callable

DEFAULT_RETRY_AFTER = 30.0
# Ack.reason of a relay that could not reach its next hop: nothing was delivered, so the sender
# may try another relay (same message id) or, having none, treat it as a definite refusal.
RELAY_UNREACHABLE = "relay_unreachable"
# Relays for a peer found unreachable go nearest first, by the round trip of this node's Hellos to
# them (the least of the last RTT_SAMPLES: a connect or a busy moment only adds). Those within
# NEAR_FACTOR x the nearest's RTT + NEAR_SLACK count as equally near (a Hello through Python gRPC
# varies by milliseconds on a busy machine; a WAN detour costs tens), and the destinations spread
# over them: measured on 6 nodes behind two routers, the noise of one Hello each put every relayed
# pair on one relay at 1.5x + 2 ms, and SGP's step went from 1.6x to 1.8x the all-public one.
RTT_SAMPLES = 8
NEAR_FACTOR = 2.0
NEAR_SLACK = 0.010


def spread(sender: int, destination: int, relay: int, salt: int = 0) -> int:
    """A relay's place for one (sender, destination) pair, or one message of it (`salt`: its id):
    a fixed pseudo-random 32-bit number, the same on every run (a multiply-xorshift mix)."""
    x = (sender * 0x9E3779B1 + destination * 0x85EBCA77 + relay * 0xC2B2AE3D + salt * 0x165667B1
         + 0x27D4EB2F) & 0xFFFFFFFF
    for multiplier in (0x7FEB352D, 0x846CA68B):
        x ^= x >> 16
        x = x * multiplier & 0xFFFFFFFF
    return x ^ x >> 16


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
        self.private: set[int] = set()  # peers that said they cannot be dialled (reachability.py)
        self._rtts: dict[int, deque[float]] = {}
        self._demoted: dict[int, float] = {}  # relay -> until when it goes last (a hop through it timed out)

    def note_rtt(self, peer: int, seconds: float) -> None:
        """A Hello to `peer` came back after `seconds` (membership/greetings.py)."""
        if math.isfinite(seconds) and seconds >= 0:
            self._rtts.setdefault(peer, deque(maxlen=RTT_SAMPLES)).append(seconds)

    def rtt(self, peer: int) -> float | None:
        """The round trip to `peer` (seconds), or None before a Hello came back from it."""
        samples = self._rtts.get(peer)
        return min(samples) if samples else None

    def detects(self, peer: int) -> bool:
        """A failed connect to `peer` is found out at once and relayed around: relays are configured,
        or the peer said it is private (behind NAT: only the peers it opened a reverse stream to
        reach it, and they relay for the others)."""
        return self.relays is not None or peer in self.private

    def note_private(self, peer: int, private: bool) -> None:
        """What `peer`'s Hellos say of its reachability (reachability.py)."""
        if private:
            self.private.add(peer)
        else:
            self.private.discard(peer)

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

    def reached(self, peer: int) -> bool:
        """A direct send (or connect) to `peer` worked, and its link was not found down since."""
        return peer in self._reached

    def mark_reached(self, peer: int) -> None:
        self._down_until.pop(peer, None)
        self._reached.add(peer)

    def demote(self, relay: int) -> None:
        """A hop through `relay` timed out: it may be stalled (or the destination is). It goes last
        among the candidates for `retry_after` seconds, so the next try takes another relay; it is
        not dropped, since all of them time out while the destination itself is stalled."""
        self._demoted[relay] = self.clock() + self.retry_after

    def _is_demoted(self, relay: int) -> bool:
        until = self._demoted.get(relay)
        if until is not None and self.clock() >= until:
            del self._demoted[relay]
            return False
        return until is not None

    def _distance(self) -> Callable[[int], tuple[int, float]]:
        """Sort key of relays: (0, 0) near (see NEAR_FACTOR), (1, rtt) farther, (2, 0) not measured."""
        rtts = {relay: self.rtt(relay) for relay in self._reached}
        known = [rtt for rtt in rtts.values() if rtt is not None]
        near = min(known) * NEAR_FACTOR + NEAR_SLACK if known else math.inf

        def distance(relay: int) -> tuple[int, float]:
            rtt = rtts.get(relay)
            return (2, 0.0) if rtt is None else (0, 0.0) if rtt <= near else (1, rtt)
        return distance

    def candidates(self, peer: int, message_id: int | None = None) -> list[int]:
        """Relays to try for `peer`, best first: the configured ones, then peers reached directly,
        nearest first; never the peer itself, us, or a relay whose link is down or that just timed
        out (demote). Per message (`message_id` given) the equally near ones take turns, so even
        one pair's traffic (a ring hop) spreads over them."""
        order = list(self.relays or ())
        # peers reached directly, the nearest first; among equally near ones in an order of their own
        # per (sender, destination) pair or message, so relayed load spreads over them (rendezvous
        # hashing: a relay that goes away moves only the pairs it carried)
        salt = 0 if message_id is None else message_id
        order += sorted(sorted(self._reached, key=lambda relay: spread(self.rank, peer, relay, salt)),
                        key=self._distance())
        configured = set(self.relays or ())
        usable = [r for r in dict.fromkeys(order)  # (a private peer relays only where configured to)
                  if r not in (peer, self.rank) and self.direct_ok(r) and not self.blocked(r)
                  and (r not in self.private or r in configured)]
        return sorted(usable, key=self._is_demoted)  # (stable: the demoted go last, in the same order)


__all__ = ["RouteTable", "DEFAULT_RETRY_AFTER", "NEAR_FACTOR", "NEAR_SLACK", "RELAY_UNREACHABLE", "RTT_SAMPLES"]
