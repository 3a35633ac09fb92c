"""Which peers a node considers alive, and from which step it expects their messages.

A crashed peer must not stall the others: a node that fails to reach a peer (its connect is
refused, or it misses a deadline and then does not answer a Hello probe) declares it dead, and
the algorithms neither send to it nor wait for it. A (re)joining peer announces itself with a
ready Hello carrying the step it resumes at; from then on it is alive again, and messages are
awaited from it only for steps at or after that step (it never sent the earlier ones).

A node that itself rejoins has the mirror problem: its peers learn of it at different steps, so
it waits only for peers it has heard from since (it is "unconfirmed" about the others, whose
messages are still folded in whenever they come).

Written on the transport's loop thread, read from the training thread: every set is replaced,
never mutated, so a reader always sees a consistent snapshot.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Iterable

log = logging.getLogger(__name__)


class Membership:
    def __init__(self, rank: int, world_size: int, metrics=None):
        self.rank = rank
        self.world_size = world_size
        self.metrics = metrics
        self._dead: frozenset[int] = frozenset()
        self._unconfirmed: frozenset[int] = frozenset()
        self._alive_since: dict[int, int] = {}   # peer -> first step we expect from it after a rejoin
        self._changed_at: dict[int, float] = {}
        self.on_change: Callable[[], None] = lambda: None  # e.g. wake receivers waiting on a dead peer
        if metrics is not None:
            for peer in self.peers:
                metrics.set_peer_up(peer, True, len(self.peers))

    @property
    def peers(self) -> list[int]:
        return [p for p in range(self.world_size) if p != self.rank]

    # Reads (any thread) --------------------------------------------------------------------------
    def alive(self, peer: int) -> bool:
        return peer not in self._dead

    def dead(self) -> frozenset[int]:
        return self._dead

    def live(self, peers: Iterable[int]) -> list[int]:
        dead = self._dead
        return [p for p in peers if p not in dead]

    def awaited(self, peers: Iterable[int], step: int) -> list[int]:
        """The peers whose step-`step` message is worth waiting for: alive, heard from since our own
        rejoin, and not rejoined after `step` themselves."""
        dead, unconfirmed, since = self._dead, self._unconfirmed, self._alive_since
        return [p for p in peers if p not in dead and p not in unconfirmed and step >= since.get(p, 0)]

    # Writes (loop thread) ------------------------------------------------------------------------
    def mark_dead(self, peer: int, why: str) -> None:
        if peer in self._dead or peer == self.rank:
            return
        self._dead = self._dead | {peer}
        self._changed(peer, False)
        log.warning("node %d: peer %d considered dead (%s)", self.rank, peer, why)

    def mark_alive(self, peer: int, since_step: int | None = None) -> None:
        """`peer` is up; with `since_step` it (re)joined and resumes at that step."""
        if since_step is not None and since_step > self._alive_since.get(peer, 0):
            self._alive_since = {**self._alive_since, peer: since_step}
        if peer in self._dead:
            self._dead = self._dead - {peer}
            self._changed(peer, True)
            log.info("node %d: peer %d is alive again (resumes at step %s)", self.rank, peer, since_step)

    def heard_from(self, peer: int) -> None:
        """A message from `peer` arrived: it is alive and (after our rejoin) confirmed."""
        if peer in self._unconfirmed:
            self._unconfirmed = self._unconfirmed - {peer}
        if peer in self._dead:
            self.mark_alive(peer)

    def rejoining(self) -> None:
        """This node rejoins a running cluster: don't wait for anyone until they have sent to us."""
        self._unconfirmed = frozenset(self.peers)

    def _changed(self, peer: int, up: bool) -> None:
        self._changed_at[peer] = time.monotonic()
        if self.metrics is not None:
            self.metrics.set_peer_up(peer, up, len(self.peers) - len(self._dead))
            self.metrics.on_membership_change(peer)
        self.on_change()


__all__ = ["Membership"]
