"""Elastic membership views: which nodes train together from which step on.

Every change of the members (the ranks the topology or the ring is built over) is a *view* (epoch,
proposer, switch_step, members), proposed by the node that causes or notices it and sent to every
member in a Hello. `switch_step` lies a margin ahead of every step the proposer knows of, so all
nodes switch at the same step boundary. Views are ordered by (epoch, proposer) (Views.adopt), so
once the nodes have heard of the same views they answer `members_at(step)` the same way for every step.

Plain data: nothing here sends or waits; greetings.py carries views in Hellos, liveness.py judges
who is alive (a dead member stays a member until a view without it takes effect).
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

from p2ptrain._proto import p2ptrain_pb2 as pb

log = logging.getLogger(__name__)

DEFAULT_VIEW_MARGIN = 8  # steps between the furthest step a proposer knows of and the switch
MAX_COUNTER = 1 << 53    # epochs and steps stay below this (exact in a double, far from uint64's end)
MAX_ADDRESS = 255        # characters of a member's address in a view


def brief(values, limit: int = 8) -> str:
    """A peer-sent list for a log line: at most `limit` items (a hostile view may hold millions)."""
    values = list(values[:limit + 1]) if hasattr(values, "__getitem__") else list(values)
    shown = ", ".join(str(v)[:40] for v in values[:limit])
    return f"[{shown}{', ...' if len(values) > limit else ''}]"


def gossip_targets(ring, rank: int) -> list[int]:
    """The nodes at offsets 1, 2, 4, ... (below len(ring)) after `rank` on `ring` (rank joins it
    where it is not there): ⌈log2 m⌉ of them, so that a view every adopter passes on to its own
    reaches all m nodes of the ring within ⌈log2 m⌉ hops from any of them, at O(log m) calls each."""
    ring = sorted(set(ring) | {rank})
    m, at = len(ring), ring.index(rank)
    offsets, offset = [], 1
    while offset < m:
        offsets.append(offset)
        offset *= 2
    return [ring[(at + k) % m] for k in offsets]


@dataclass(frozen=True)
class View:
    """One change of the members. Nodes join a running cluster and leave it without anyone
    restarting, so the set of members changes while training runs. A view is proposed by the node
    that causes or notices the change (a donor admitting a joiner, a node leaving, a ring member
    that found a peer dead) and sent to every member in a Hello. `switch_step` lies a margin ahead
    of every step the proposer knows of, so each node learns of it before it gets there and all of
    them switch at the same step boundary."""

    epoch: int
    proposer: int
    switch_step: int
    members: tuple[int, ...]
    addresses: tuple[str, ...] = ()  # members[i]'s address, "" where the receiver already knows it
    placement: tuple[int, ...] = ()  # the members in ring / graph order; () = rank order (placement.py)
    # members that were not in the proposer's latest view: they enter with a donor's copy, and the
    # holders hand them the members' state at the switch (algorithms/state_handout.py)
    entering: tuple[int, ...] = ()
    # the view it was proposed on top of, (epoch - 1, base_proposer), and the members of that base
    # it leaves out: a receiver that does not hold the base tells a left-out member the proposer
    # never heard of (a concurrent admission) from one it drops (vetting.py)
    base_proposer: int = 0
    dropping: tuple[int, ...] = ()

    @functools.cached_property
    def member_set(self) -> frozenset[int]:
        """`members` for `in` tests: liveness asks it for every peer it heard from at every step,
        and a tuple's test is O(n) (a thousand members: milliseconds a step)."""
        return frozenset(self.members)

    @property
    def placed(self) -> tuple[int, ...]:
        """The members in the order rings and graphs lay them out."""
        return self.placement or self.members

    @property
    def order(self) -> tuple[int, int]:
        return self.epoch, self.proposer

    def to_proto(self) -> pb.View:
        return pb.View(epoch=self.epoch, proposer=self.proposer, switch_step=self.switch_step,
                       members=list(self.members), addresses=list(self.addresses), placement=list(self.placement),
                       entering=list(self.entering), base_proposer=self.base_proposer,
                       dropping=list(self.dropping))

    @functools.cached_property
    def wire(self) -> pb.View:
        """What a Hello carries of this view (built once: at 1,024 members, building it for every
        Hello was 7 of 12 samples of a start-up loop). The initial view only as its digest: every node
        builds it from the same configuration, and a receiver ignores a view whose order is not
        above its own, so the full one never said more. Callers copy it, never change it."""
        return self.digest() if self.epoch == 0 else self.to_proto()

    def digest(self) -> pb.View:
        """The view's order alone, for a peer known to hold it (a Hello's view is O(members))."""
        return pb.View(epoch=self.epoch, proposer=self.proposer)

    @classmethod
    def from_proto(cls, message: pb.View, capacity: int) -> "View":
        """The view a peer sent; ValueError (a short reason) for one no honest node proposes."""
        if len(message.members) > capacity:
            raise ValueError(f"view names {len(message.members)} members, more than the {capacity} ranks there are")
        members = tuple(message.members)
        if not members or list(members) != sorted(set(members)) or members[-1] >= capacity:
            raise ValueError(f"view members {brief(members)} must be distinct sorted ranks below {capacity}")
        if message.addresses and len(message.addresses) != len(members):
            raise ValueError(f"view names {len(message.addresses)} addresses for {len(members)} members")
        if any(len(a) > MAX_ADDRESS or not a.isprintable() for a in message.addresses):
            raise ValueError(f"view holds an address longer than {MAX_ADDRESS} characters or unprintable")
        if message.proposer >= capacity:
            raise ValueError(f"view proposer {message.proposer} is no rank below {capacity}")
        if message.epoch >= MAX_COUNTER or message.switch_step >= MAX_COUNTER or \
                (message.epoch > 0 and message.switch_step == 0):  # (only the initial view switches at 0)
            raise ValueError(f"view epoch {message.epoch} / switch step {message.switch_step} out of range "
                             f"(1 .. 2^53)")
        placement = tuple(message.placement)
        if placement and sorted(placement) != list(members):
            raise ValueError(f"view placement {brief(placement)} is not an order of its members {brief(members)}")
        entering = tuple(message.entering)
        if list(entering) != sorted(set(entering)) or not set(entering) <= set(members):
            raise ValueError(f"view entering {brief(entering)} must be distinct sorted members")
        if len(message.dropping) > capacity:
            raise ValueError(f"view drops {len(message.dropping)} members, more than the {capacity} ranks there are")
        dropping = tuple(message.dropping)
        if list(dropping) != sorted(set(dropping)) or (dropping and dropping[-1] >= capacity) \
                or set(dropping) & set(members):
            raise ValueError(f"view dropping {brief(dropping)} must be distinct sorted ranks outside its members")
        if message.base_proposer >= capacity:
            raise ValueError(f"view base proposer {message.base_proposer} is no rank below {capacity}")
        return cls(message.epoch, message.proposer, message.switch_step, members, tuple(message.addresses),
                   placement, entering, message.base_proposer, dropping)


def _in_force(history: tuple[View, ...], step: int) -> View:
    """The view of `history` (oldest first) in force at `step`."""
    return next((view for view in reversed(history) if view.switch_step <= step), history[0])


class Views:
    """The views node `rank` holds, oldest first (epochs increase), starting with `initial`."""

    def __init__(self, rank: int, initial: tuple[int, ...], capacity: int):
        self.rank = rank
        self.capacity = capacity
        self._history: tuple[View, ...] = (View(0, 0, 0, tuple(sorted(initial))),)
        self._member_since: tuple[tuple, dict[int, int]] = ((), {})  # (the views, member_since's answers for them)
        self.members_ever: frozenset[int] = frozenset(initial)  # every rank that was a member once

    @property
    def latest(self) -> View:
        return self._history[-1]

    @property
    def changed(self) -> bool:
        """Some view after the initial one was adopted (an elastic run is under way)."""
        return len(self._history) > 1

    def members_at(self, step: int) -> tuple[int, ...]:
        """The members at `step`: those of the latest view that took effect by then."""
        return self.view_at(step).members

    def placed_at(self, step: int) -> tuple[int, ...]:
        """The members at `step` in the order rings and graphs lay them out."""
        return self.view_at(step).placed

    def view_at(self, step: int) -> View:
        """The view in force at `step`."""
        return _in_force(self._history, step)

    def supersedes(self, view: View, step: int) -> bool:
        """A view greater than `view` held here is in force by `step` (a node holding both would
        train by the greater one there)."""
        return any(v.order > view.order and v.switch_step <= step for v in self._history)

    def switches_at(self, step: int) -> bool:
        """Another view takes effect at `step` (a ring re-forms here, even over the same members:
        a view that repeats them is how a ring whose nodes fell out of step re-aligns)."""
        return step > 0 and self.view_at(step) is not self.view_at(step - 1)

    def entering_at(self, step: int) -> tuple[int, ...]:
        """The members that enter with a donor's copy at `step`: those of the view that switches
        there (() where none does)."""
        return self.view_at(step).entering if self.switches_at(step) else ()

    def first_switch(self, after: int, until: int) -> int | None:
        """The first step in (after, until] at which another view takes effect (None: none does)."""
        steps = sorted({v.switch_step for v in self._history if after < v.switch_step <= until})
        return next((step for step in steps if self.switches_at(step)), None)

    def member_since(self, rank: int) -> int:
        """The step since which `rank` is a member without a break (0: from the start)."""
        history = self._history  # (asked per peer and step: the answers are kept for the views held now)
        held, answers = self._member_since
        if held is not history:
            answers = {}
            self._member_since = (history, answers)
        since = answers.get(rank)
        if since is None:
            steps = sorted({v.switch_step for v in history if v.switch_step > 0}, reverse=True)
            since = answers[rank] = next((step for step in steps if rank not in _in_force(history, step - 1).members
                                          and rank in _in_force(history, step).members), 0)
        return since

    def first_step_as_member(self, rank: int, from_step: int) -> int | None:
        """The first step >= from_step at which `rank` is a member (None: it is not in any view
        from then on)."""
        if rank in self.members_at(from_step):
            return from_step
        later = [v.switch_step for v in self._history if v.switch_step > from_step and rank in v.members]
        return min(later) if later else None

    def first_step_without(self, rank: int, from_step: int) -> int | None:
        """The first step >= from_step at which `rank` is no member (None: it stays one)."""
        candidates = sorted({from_step} | {v.switch_step for v in self._history if v.switch_step > from_step})
        return next((step for step in candidates if rank not in self.members_at(step)), None)

    def base_of(self, view: View) -> View:
        """The view `view` was proposed on top of, as far as this node knows: its latest view of an
        earlier epoch (a concurrent proposal of the same epoch is no base)."""
        return next(v for v in reversed(self._history) if v.epoch < view.epoch or v.epoch == 0)

    def named_base(self, view: View) -> View | None:
        """The very view `view` was proposed on top of, (epoch - 1, base_proposer), if held here
        (every node holds the same initial view); None where this node holds another view of that
        epoch, or none: the proposer's lineage then differs from ours."""
        if view.epoch == 0:
            return None
        if view.epoch == 1:
            return self._history[0]
        wanted = (view.epoch - 1, view.base_proposer)
        return next((v for v in self._history if v.order == wanted), None)

    def dropping_view(self, rank: int) -> View | None:
        """The view that ended `rank`'s latest time as a member (the current or a pending one); None
        while the latest view holds it, or if it never was a member."""
        if rank in self.latest.members:
            return None
        for before, after in zip(reversed(self._history[:-1]), reversed(self._history[1:])):
            if rank in before.members:
                return after
        return None

    def propose(self, members, switch_step: int, addresses: dict[int, str] | None = None,
                placement: tuple[int, ...] | None = None) -> View:
        """A new view of this node's (adopted here first): `members` from `switch_step` on, laid out
        by `placement` (None: the latest view's order, newcomers after it); those not in the view in
        force just before `switch_step` enter (View.entering). It switches no earlier than the
        view it replaces (receivers refuse one that does: vetting.refusal); a caller's switch
        step read before a view with a later switch came in moves there."""
        members = tuple(sorted(set(members)))
        addresses = addresses or {}
        if placement is None:
            kept = [m for m in self.latest.placement if m in members]
            placement = tuple(kept + [m for m in members if m not in kept]) if kept else ()
        placement = tuple(placement)
        if placement == members:
            placement = ()  # (rank order: said by no placement)
        elif placement and sorted(placement) != list(members):
            raise ValueError(f"placement {list(placement)} is not an order of the members {list(members)}")
        base = self.latest
        switch_step = max(switch_step, base.switch_step)
        before = self.view_at(switch_step - 1).members  # (a pending base replaced at its switch: its newcomers too)
        view = View(base.epoch + 1, self.rank, switch_step, members,
                    tuple(addresses.get(m, "") for m in members) if addresses else (), placement,
                    tuple(m for m in members if m not in before), base.proposer,
                    tuple(m for m in base.members if m not in members))
        self.adopt(view)
        return view

    def adopt(self, view: View) -> bool:
        """Take `view` if it is greater than every view held; True if it was.

        Views are ordered by (epoch, proposer): a node adopts any view greater than the greatest it
        holds, and a later epoch replaces every view of its epoch or after (two concurrent
        proposals: the greater wins everywhere; its loser proposes again on top of it if its change
        is still missing). So once the nodes have heard of the same views they answer
        `members_at(step)` the same way for every step."""
        if view.order <= self.latest.order:
            return False
        kept = tuple(v for v in self._history if v.epoch < view.epoch)
        self._history = kept + (view,)
        self.members_ever = self.members_ever | set(view.members)
        laid_out = f", laid out as {list(view.placement)}" if view.placement else ""
        laid_out += f", {list(view.entering)} entering" if view.entering else ""
        log.info("node %d: view %d (from node %d): members %s from step %d%s", self.rank, view.epoch, view.proposer,
                 list(view.members), view.switch_step, laid_out)
        return True


__all__ = ["View", "Views", "DEFAULT_VIEW_MARGIN", "MAX_ADDRESS", "MAX_COUNTER", "brief", "gossip_targets"]
