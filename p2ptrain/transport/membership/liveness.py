"""Liveness: which peers a node considers alive, how far along they are, and who must rejoin.

A crashed or stalled peer must not stall the others, and must not corrupt them when it comes back.
A peer is dead once a node fails to reach it (a refused connect, or a missed deadline and no answer
to a Hello probe); it is alive again only as a new incarnation (a rejoin: a restarted process, or a
stalled one that took a state transfer), never by simply resuming. A peer last seen more than
max_lag steps behind is treated as dead for sending and waiting. Never: mass pushed into a node
hundreds of steps behind, or state handed to a peer that never went away (Liveness has each rule).

Written on the transport's loop thread, read from the training thread: every set and dict is
replaced, never mutated, so a reader always sees a consistent snapshot.
"""
from __future__ import annotations

import logging
import statistics
import time
from typing import Callable, Iterable

from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.transport.membership.views import Views

log = logging.getLogger(__name__)

DEFAULT_MAX_LAG = 16  # steps; see TransportOptions.max_lag


class Liveness:
    """Node `rank`'s judgement of its peers. A member (of `views`' latest view) may be judged
    lagging; one that joined at a view switch is awaited from the step it announces.

    - **Dead.** A node that fails to reach a peer (its connect is refused, or it misses a deadline and
      then does not answer a Hello probe) declares it dead: the algorithms neither send to it nor wait
      for it. Its messages are still accepted (push-sum mass must land somewhere), but every reply
      tells it that it is excluded (`Ack.sender_excluded`, `HelloReply.caller_excluded`).
    - **Back only through a rejoin.** A dead peer is alive again only when it announces a *new
      incarnation* (HelloRequest.incarnation): a restarted process, or a stalled one that took a state
      transfer to catch up. A stalled process that simply resumes keeps its old incarnation and stays
      dead until it has rejoined, so nobody pushes mass into a node that is hundreds of steps behind.
    - **Lagging.** Every message, Ack and Hello carries its sender's step. A peer that was last seen
      more than `max_lag` steps behind us (compared with our step *when we saw it*: knowledge is never
      extrapolated, so a peer we rarely hear from is not judged on old news) is treated like a dead one
      for sending and waiting (a bounded delay never lets a healthy peer fall that far behind); the
      lagging node sees the same gap from its side and catches up through a state transfer.
    - **Rejoining.** A node that rejoins resumes at the cluster's step (the furthest step the announce
      replies name): the steps it skips carry no messages for it, since nobody knew it was back. It
      waits for a peer from the step after the one that peer's reply names (or, without a reply, from
      the peer's first message); the peers wait for it from its first message. Earlier messages are
      folded in whenever they come.
    - **Donating.** A node hands its state only to a peer it saw leave (declared dead, lagging, or a new
      incarnation of it asked), never to a Hello(want_state) from a peer that never went away."""

    def __init__(self, rank: int, world_size: int, views: Views, metrics=None, *, max_lag: int = DEFAULT_MAX_LAG):
        if max_lag < 1:
            raise ValueError(f"max_lag must be >= 1 step, got {max_lag}")
        self.rank = rank
        self.world_size = world_size
        self.views = views
        self.metrics = metrics
        self.max_lag = max_lag
        self.step = 0                                   # this node's current step (Transport.set_step)
        self._dead: frozenset[int] = frozenset()
        self._unconfirmed: frozenset[int] = frozenset()
        self._alive_since: dict[int, int] = {}          # peer -> first step we expect from it after a rejoin
        self._seen_at: dict[int, tuple[int, int]] = {}  # peer -> (its step, our step) when last seen
        self._sent_step: dict[tuple[int, int], int] = {}  # (peer, kind) -> the latest step of its messages
        self._incarnations: dict[int, int] = {}         # peer -> incarnation last seen
        self._active: dict[int, int] = {}               # peer -> its incarnation last seen ready or training
        self._dead_incarnation: dict[int, int | None] = {}  # peer -> the incarnation that was declared dead
        self._excluded_by: frozenset[int] = frozenset()  # peers that told us they consider us dead
        self._finished: frozenset[int] = frozenset()     # peers that said their run is over
        self._senders: frozenset[int] = frozenset()      # peers whose messages (tensors) reached us
        self._changed_at: dict[int, float] = {}
        self._listeners: list[Callable[[], None]] = []
        if metrics is not None:
            peers = self.peers  # (a list made afresh: once, not once per peer)
            for peer in peers:
                metrics.set_peer_up(peer, True, len(peers))

    def subscribe(self, listener: Callable[[], None]) -> None:
        """Call `listener()` whenever a peer is declared dead or alive (e.g. the Inbox re-checks
        what its receivers wait for: nobody waits for a dead peer)."""
        self._listeners.append(listener)

    def _is_member(self, peer: int) -> bool:
        """In the latest view: a node that left, or has not joined yet, is not judged lagging and
        does not count towards `behind`."""
        return peer in self.views.latest.member_set

    def _joins_later(self, peer: int) -> bool:
        """A member since a view switch: it is awaited from the step it announces (>= the switch),
        and needs no first message to confirm it."""
        return self.views.member_since(peer) > 0

    @property
    def peers(self) -> list[int]:
        return [p for p in range(self.world_size) if p != self.rank]

    # Reads (any thread) --------------------------------------------------------------------------
    def alive(self, peer: int) -> bool:
        return peer not in self._dead

    def dead(self) -> frozenset[int]:
        return self._dead

    def lagging(self, peer: int) -> bool:
        """`peer` was last seen more than max_lag steps behind us, as a member: where it was before
        the view that admitted it says nothing (a joiner runs to the members' step waiting for
        nobody; seen early in that run, it was taken for a laggard once admitted, sent nothing, and
        waited a link deadline for shares that did not come)."""
        seen = self._seen_at.get(peer)
        return seen is not None and seen[1] - seen[0] > self.max_lag and self._is_member(peer) \
            and seen[0] >= self.views.member_since(peer)

    def live(self, peers: Iterable[int]) -> list[int]:
        """The peers to send to: not dead, not lagging, not finished."""
        dead, finished = self._dead, self._finished
        return [p for p in peers if p not in dead and p not in finished and not self.lagging(p)]

    def awaited(self, peers: Iterable[int], step: int, *, laggards: bool = False) -> list[int]:
        """The peers whose step-`step` message is worth waiting for: alive, not finished, not lagging
        (unless `laggards`), heard from since our own rejoin, and not rejoined after `step` themselves."""
        dead, unconfirmed, since, finished = self._dead, self._unconfirmed, self._alive_since, self._finished
        return [p for p in peers if p not in dead and p not in unconfirmed and p not in finished
                and step >= since.get(p, 0) and (laggards or not self.lagging(p))]

    def finished(self) -> frozenset[int]:
        """The peers that said their run is over (note_finished)."""
        return self._finished

    def runs_ahead(self) -> list[int]:
        """The live members last seen more than the lag limit behind this node, when they are most
        of the live members: this node runs ahead alone (its peers stalled, or it skipped them), and
        racing on would only widen the gap. [] otherwise, and always without faults (members stay
        within the bounded delay, far inside the lag limit)."""
        others = [p for p in self.views.latest.members if p != self.rank and p not in self._dead]
        behind = [p for p in others if self.lagging(p)]
        return behind if others and 2 * len(behind) > len(others) else []

    def peer_step(self, peer: int, heard_since: int | None = None) -> int | None:
        """The latest step `peer` was heard at; None if never, or (with `heard_since`) not since
        this node was at that step (old news)."""
        seen = self._seen_at.get(peer)
        if seen is None or (heard_since is not None and seen[1] < heard_since):
            return None
        return seen[0]

    def excluded_by(self) -> frozenset[int]:
        """Peers that consider this node dead: it must rejoin before they wait for it again."""
        return self._excluded_by

    def behind(self) -> int:
        """By how many steps the median live peer was ahead of this node when last seen (<= 0: not
        behind). A peer whose run is over does not count: it gives no state, so a node that trails
        only finished peers would wait for a donor in vain (a link deadline or two, each time).
        Nor does what a joiner saw before the view that admitted it: it waited for nobody then, and
        ran to the members' step far faster than they move (one that had seen them 22 steps ahead
        while it ran took itself for a laggard once admitted, and left to catch up: 60 s lost)."""
        dead, finished, since = self._dead, self._finished, self.views.member_since(self.rank)
        gaps = [theirs - ours for p, (theirs, ours) in self._seen_at.items()
                if ours >= since and p not in dead and p not in finished and self._is_member(p)]
        return int(statistics.median(gaps)) if gaps else 0

    def must_catch_up(self) -> bool:
        """This node must rejoin through a state transfer: a peer excluded it, or it trails the
        cluster by more than max_lag steps."""
        return bool(self._excluded_by) or self.behind() > self.max_lag

    def excludes(self, peer: int) -> bool:
        """We consider `peer` dead (its replies should tell it to rejoin)."""
        return peer in self._dead

    def incarnation(self, peer: int) -> int:
        """The incarnation of `peer` we last heard (0: none; a node that restarted knows none of the others)."""
        return self._incarnations.get(peer, 0)

    def may_donate_to(self, peer: int, incarnation: int = 0, known_before: int | None = None) -> bool:
        """Hand our state only to a peer we saw leave: declared dead, lagging, restarted (a new
        incarnation asks), or one whose earlier self we never heard (we restarted since, so we cannot
        have seen it leave: refusing would leave it without a donor). `known_before`: the incarnation
        we knew before this Hello (default: the one we know now). A Hello(want_state) from a peer
        that never went away gets nothing."""
        known = self.incarnation(peer) if known_before is None else known_before
        restarted = bool(incarnation) and incarnation != known
        return peer in self._dead or self.lagging(peer) or restarted

    # Writes (loop thread) ------------------------------------------------------------------------
    def mark_dead(self, peer: int, why: str) -> None:
        if peer in self._dead or peer == self.rank:
            return
        self._dead_incarnation = {**self._dead_incarnation, peer: self._incarnations.get(peer)}
        self._dead = self._dead | {peer}
        self._changed(peer, False)
        log.warning("node %d: peer %d considered dead (%s)", self.rank, peer, why)

    def mark_alive(self, peer: int, since_step: int | None = None) -> None:
        """`peer` is up; with `since_step` it (re)joined and resumes at that step or later (it
        moves on to the cluster's step): it is awaited from its first message of the training on."""
        if since_step is not None and since_step > self._alive_since.get(peer, 0):
            self._alive_since = {**self._alive_since, peer: since_step}
            if not self._joins_later(peer):
                self._unconfirmed = self._unconfirmed | {peer}
            self.note_step(peer, max(since_step, self.step))  # it joins at our step: not lagging
        if peer in self._dead:
            self._dead = self._dead - {peer}
            self._changed(peer, True)
            log.info("node %d: peer %d is alive again (resumes at step %s)", self.rank, peer, since_step)

    def note_step(self, peer: int, step: int) -> None:
        """`peer` is at `step` now (from a message header, an Ack or a Hello); older news is ignored."""
        if 0 <= peer < self.world_size and peer != self.rank and step >= self._seen_at.get(peer, (-1, 0))[0]:
            self._seen_at = {**self._seen_at, peer: (step, self.step)}

    def hello(self, peer: int, *, ready: bool, incarnation: int, current_step: int, resume_step: int) -> None:
        """A Hello from `peer`. A new incarnation is a restarted or caught-up process: a ready one
        is alive from `resume_step` on; one that is not ready yet (it is fetching state) means its
        earlier self is gone. The same incarnation never revives a peer declared dead."""
        known = self._incarnations.get(peer)
        if incarnation:
            self._incarnations = {**self._incarnations, peer: incarnation}
        if ready:
            self.note_ready(peer, incarnation)
        new = bool(incarnation) and incarnation != known
        if new and known is not None:  # a fresh start: forget its steps, and that its run was over
            self._seen_at = {p: s for p, s in self._seen_at.items() if p != peer}
            self._sent_step = {key: s for key, s in self._sent_step.items() if key[0] != peer}
            self._finished = self._finished - {peer}
        self.note_step(peer, current_step)
        if peer in self._dead:
            if new and ready and incarnation != self._dead_incarnation.get(peer):
                self.mark_alive(peer, since_step=resume_step or None)
            return
        if new and known is not None:
            if ready:
                self.mark_alive(peer, since_step=resume_step or None)
            elif self._active.get(peer) == known:  # (a joiner's earlier self, never ready, held nothing)
                self.mark_dead(peer, "restarted (a new incarnation asks for state)")

    def note_finished(self, peer: int) -> None:
        """`peer` said its run is over (a Hello, or its refusal of our state request): every message
        it sent us was acknowledged before it said so, and it sends nothing more, so it is neither
        sent to nor waited for. A node left behind then trains on to its end alone instead of
        waiting a link deadline per step. Only a new incarnation of it (a restart) takes it back."""
        if peer not in self._finished and peer != self.rank:
            self._finished = self._finished | {peer}
            for listener in self._listeners:  # (waits for it end)
                listener()

    def note_ready(self, peer: int, incarnation: int) -> None:
        """`peer` as `incarnation` is ready (its Hello or reply said so): a later incarnation asking
        for state means this one is gone."""
        if incarnation and self._active.get(peer) != incarnation:
            self._active = {**self._active, peer: incarnation}

    def heard_from(self, peer: int, step: int | None = None, kind: int | None = None) -> None:
        """A message from `peer` arrived. After our own rejoin, its first message of the training
        (not a state transfer) confirms it: it sends to us from that message's step on, so earlier
        steps (when it did not know we were back) are not waited for; their messages, if any come,
        are folded in late. It never revives a dead peer (only a rejoin does)."""
        if peer not in self._senders:
            self._senders = self._senders | {peer}
        if kind != pb.MESSAGE_KIND_STATE and peer in self._incarnations:
            self.note_ready(peer, self._incarnations[peer])  # (it trains: it was ready)
        if peer in self._unconfirmed and kind != pb.MESSAGE_KIND_STATE:
            self._unconfirmed = self._unconfirmed - {peer}
            if step is not None and step > self._alive_since.get(peer, 0):
                self._alive_since = {**self._alive_since, peer: step}
        if step is not None:
            self.note_step(peer, step)
            if kind is not None and step > self._sent_step.get((peer, kind), -1):
                self._sent_step = {**self._sent_step, (peer, kind): step}

    def senders(self) -> frozenset[int]:
        """The peers whose messages ever reached this node."""
        return self._senders

    def sent_step(self, peer: int, kind: int) -> int | None:
        """The latest step of a `kind` message `peer` sent us (a message's own step, not the
        sender's current one, which may run ahead of it); None if none came."""
        return self._sent_step.get((peer, kind))

    def excluded(self, by_peer: int) -> None:
        """`by_peer` says it considers us dead."""
        if by_peer not in self._excluded_by:
            self._excluded_by = self._excluded_by | {by_peer}
            log.warning("node %d: peer %d considers this node dead; it will rejoin", self.rank, by_peer)

    def confirmed(self, peer: int, since_step: int) -> None:
        """After our rejoin: `peer` answered our announce at step since_step - 1, so it sends to us
        from since_step on; wait for its messages from then."""
        self._alive_since = {**self._alive_since, peer: since_step}
        self._unconfirmed = self._unconfirmed - {peer}

    def rejoining(self) -> None:
        """This node rejoins a running cluster: don't wait for anyone until they have sent to us."""
        self._unconfirmed = frozenset(self.peers)

    def rejoined(self) -> None:
        """A state transfer completed: nobody needs to exclude us any more (our announce will tell
        them), and what we saw of the others from far behind is stale."""
        self._excluded_by = frozenset()
        self._seen_at = {}

    def _changed(self, peer: int, up: bool) -> None:
        self._changed_at[peer] = time.monotonic()
        if self.metrics is not None:
            self.metrics.set_peer_up(peer, up, len(self.peers) - len(self._dead))
            self.metrics.on_membership_change(peer)
        for listener in self._listeners:
            listener()


__all__ = ["Liveness", "DEFAULT_MAX_LAG"]
