"""A ring all-reduce over each step's members, and how its members come together when those change.

AllReduce-SGD and Pipe-SGD train over it while nodes join, leave or die. At each view switch the
members average their model (then their optimizer state) in one ring call over [w x, w]: w is 1
on a node that holds the members' state and 0 on one that took a donor's copy since (a restarted,
joining or caught-up node), so that node enters with the holders' state as of the switch step and
the holders, had they run apart, come together again. Without such a node it is the plain mean.
Nodes new in the view (View.entering) sit that average out: the holders hand them its result
directly (state_handout.py), so their state crosses the wire once.
"""
from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING

from p2ptrain.algorithms.base import Comm
from p2ptrain.algorithms.collectives import CollectiveIncomplete, RingAllReduce
from p2ptrain.algorithms.host_allreduce import HostAllReduce
from p2ptrain.algorithms.state_handout import Outgoing, StateHandout

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

REALIGN_AFTER = 3  # rounds failed in a row before a ring re-forms over the same members


class MemberRing:
    """Ring all-reduce over each step's members (Comm.members), re-formed when they change: how
    AllReduce-SGD and Pipe-SGD keep training together while nodes join, leave or die, instead of
    each training alone.

    - A round that cannot complete keeps the local value for that step, and this node proposes the
      members without the peers it declared dead (a view switch a margin ahead, see views.py); after
      REALIGN_AFTER failed rounds in a row it proposes the same members again: members kept
      different values, or fell out of step (each waits for a step the others are not at).
    - Until the switch, a ring with a member that a pending view drops without its own say (it
      died) is not tried: every member skips it at once instead of waiting out link deadlines.
    - At the first step of a view (Algorithm.members_changed, before the step's round) the model is
      averaged over the new ring, with a deadline long enough to wait for the slowest member
      (switch_deadline: paced, and cut short when a member is found dead or dropped): it
      re-aligns the nodes' steps and brings back together models that trained apart while the ring
      was broken, so the members are bit-identical again.
    - A node that took a donor's state since it last averaged (joined, restarted, caught up:
      `holds_state` False) weighs 0 in that average, so it enters with the holders' model and
      optimizer state as of the switch step (as torchft heals), instead of pulling the others back
      towards its older copy. With every member holding the state the weights are all 1: the
      plain mean, as before.
    - Members new in the view (View.entering) sit that average out: the others average over their
      own ring and hand them the result, a slice from each host (StateHandout)."""

    def __init__(self, comm: Comm, numel: int, dtype: torch.dtype | None = None, *, codec=None,
                 resync_deadline: float = 30.0, chunk_bytes: int = 0,
                 state: tuple[int, torch.dtype] | None = None, holds_state: bool = True,
                 host_memory: bool = False):
        import torch  # (here, not at import: the algorithm registry loads without torch)

        self.comm = comm
        self.rank = comm.rank
        self.ring = RingAllReduce(comm, numel, dtype, codec=codec, elastic=True, chunk_bytes=chunk_bytes)
        # each step's rounds: through this host's shared memory where all members run here (host_memory)
        self.host = HostAllReduce(comm, self.ring) if host_memory else None
        # the switch averages: [w x, w] in one call (w = holds_state)
        self.sync = RingAllReduce(comm, numel + 1, dtype, tag="sync.", elastic=True)
        # `state`: (numel, dtype) of the optimizer state, averaged with the model at a switch
        self.state_sync = RingAllReduce(comm, state[0] + 1, state[1], tag="osync.", elastic=True) \
            if state and state[0] else None
        # ... handed to the nodes that enter at a switch (View.entering) by the others, who average alone
        self.handout = StateHandout(comm, numel, self.ring.dtype, tag="hand.")
        self.state_handout = StateHandout(comm, state[0], state[1], tag="ohand.") if self.state_sync else None
        self.resync_deadline = resync_deadline  # the most a switch average waits for a segment (switch_deadline)
        # at the end of the run: Σ "a round was skipped or failed here" and Σ holds_state
        self.end_flags = RingAllReduce(comm, 2, torch.float64, tag="end.", elastic=True)
        # False from taking a donor's state (a joiner's, a restarted or caught-up node's) until a
        # switch average completes: then its state is the members' again
        self.holds_state = holds_state
        self.resyncs = 0  # model averages at view switches (stats, tests)
        self.end_averages = 0  # model averages at the end of the run (stats, tests)
        # a round was skipped or failed here since the members last averaged. Written by the thread
        # that runs the rounds (the comm worker when they overlap compute), read by agree_at_end
        # after finish() drained that worker: one bool, stored and loaded whole, so no lock
        self._apart = False
        self._weight: float | None = None  # this node's w in the last model average (resync_state follows it)
        self._resynced_at: int | None = None  # the step whose model average completed (resync_state follows it)
        self._handed_at: int | None = None  # the step whose switch handed the model out (resync_state follows it)
        self._averaged_over: tuple[int, ...] | None = None  # the members the last model average was over
        self._failures = 0  # rounds failed in a row
        # (bytes, start, end on time.monotonic(), switch step) of each state this node took with w = 0 or was handed
        self.received: list[tuple[float, float, float, int]] = []
        # a holder's model hand-out of a switch, kept until the optimizer state's is averaged too:
        # (step, its slice, the members); both are then sent at once (resync_state)
        self._model_handout: tuple[int, Outgoing, tuple[int, ...], tuple[int, ...]] | None = None

    def stats(self) -> dict[str, float]:
        """Switch averages, and the state this node took with weight 0 (MB and seconds, model and
        optimizer state together; bench heal divides them). A switch's seconds run from the first
        byte it took to the last, the gap between its model and optimizer state included."""
        stats = {"ring_resyncs": float(self.resyncs)}
        if self.host is not None:
            stats["host_rounds"] = float(self.host.rounds)
        if self.received:
            spans: dict[int, tuple[float, float]] = {}
            for _, began, ended, step in self.received:
                first, last = spans.get(step, (began, ended))
                spans[step] = (min(first, began), max(last, ended))
            stats.update(state_received_mb=sum(r[0] for r in self.received) / 1e6,
                         state_received_seconds=covered_seconds(list(spans.values())))
        return stats

    # Rounds ------------------------------------------------------------------------------------
    def reduce_or_keep(self, tensor: torch.Tensor, step: int, *, average: bool = True,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        """The all-reduce over the step's members, or `tensor` unchanged when it cannot complete.
        With `out` the mean is written there and `tensor` is only read (no backup of it is taken)."""
        members = self.members_for(step)
        if members is None:
            return tensor
        try:
            reduced = (self.host or self.ring)(tensor, step, average=average, members=members, out=out)
        except CollectiveIncomplete as exc:
            self.round_failed(exc)
            return tensor
        self.round_completed()
        return reduced

    def members_for(self, step: int) -> tuple[int, ...] | None:
        """The ranks to reduce over at `step`, or None when this step's round is skipped (this node
        alone, not a member, or a member a pending view drops is still in the ring). Rings of
        other tensors that follow the same members (gradient buckets) ask here too."""
        self._flush_model_handout(before=step)
        members = self.comm.membership.members(step)
        if self.rank not in members or len(members) == 1:
            return None
        departing = self.comm.membership.departing(step)
        if departing:
            log.info("node %d: step-%d all-reduce skipped: node(s) %s are being dropped from the ring", self.rank,
                     step, sorted(departing))
            self._apart = True
            return None
        return tuple(members)

    def round_failed(self, exc: CollectiveIncomplete) -> None:
        """A round over members_for(step) could not complete (the caller keeps its local value):
        propose the members without dead peers, and re-form after REALIGN_AFTER failures in a row."""
        log.warning("%s; keeping the local value for this step", exc)
        self._apart = True
        self.comm.membership.drop_dead_members()
        self._failures += 1
        if self._failures >= REALIGN_AFTER:  # not a dead member (that proposal comes first): re-form
            self._failures = 0
            self.comm.membership.realign()  # (nothing new while a switch is pending)

    @property
    def apart(self) -> bool:
        """A round failed or was skipped here since the members last averaged."""
        return self._apart

    def round_completed(self) -> None:
        self._failures = 0

    # Switches ----------------------------------------------------------------------------------
    def switch_deadline(self, m: int) -> float:
        """How long each segment of a switch average is awaited: long enough for a member up to the
        lag limit behind to come level (this node's measured pace) and for a hop's link deadline
        at each of the m members, at most `resync_deadline`. A member that dies meanwhile ends the
        wait at once (RingHops.hopeless)."""
        link_deadline = self.comm.link_deadline
        return min(self.resync_deadline, max(m * link_deadline, self.comm.membership.seconds_for_lag()))

    def resync(self, params: torch.Tensor, step: int) -> torch.Tensor:
        """At the first step of a view: the members' mean model, weight 0 on those that do not hold
        the members' state, handed out to those that enter (`params` unchanged if it cannot complete)."""
        self._weight = 1.0 if self.holds_state else 0.0
        self._handed_at = self._averaged_over = None
        if self._handing_out(step):
            averaged, done = self._hand_out(self.sync, self.handout, params, step, "models",
                                            with_state=self.state_handout is not None)
            self._handed_at = step
        else:
            averaged, done = self._average_at_switch(self.sync, params, step, "models", self._weight)
        self.resyncs += done
        self._note(step, done)
        return averaged

    def agree_at_end(self, params: torch.Tensor, step: int) -> torch.Tensor:
        """At the end of the run (every member calls it at the same step): if a round was skipped or
        failed on any member since the last switch average, or a member holds a donor's copy, the
        members average once more (weight 0 on such copies while any member holds the state) and
        end bit-identical. Otherwise `params` is returned untouched: in a fault-free run this costs
        one 2-element all-reduce and changes no bit.

        Members this node declared dead, and those that said their run is over, are left out: no
        view will drop them any more, and a ring with them cannot complete (the lifecycle first
        waits for members far behind and greets the rest: one that answers comes level, one that
        does not is declared dead). The others left out the same ones (they greeted them alike),
        so they end bit-identical among themselves; a node that differs here fails the call on
        all, as a wrong ring always does."""
        import torch

        self._resynced_at = self._handed_at = None
        self._flush_model_handout(before=step + 1)
        membership = self.comm.membership
        gone = membership.dead() | membership.finished()
        members = tuple(m for m in membership.members(step) if m not in gone)
        self._averaged_over = members
        if self.rank not in members or len(members) == 1:
            return params
        flags = torch.tensor([1.0 if self._apart else 0.0, 1.0 if self.holds_state else 0.0], dtype=torch.float64)
        try:
            apart, holders = self.end_flags(flags, step, average=False, members=members,
                                            deadline=self.switch_deadline(len(members))).tolist()
        except CollectiveIncomplete as exc:
            log.warning("%s; the members' models may differ at the end", exc)
            return params
        if apart == 0 and holders == len(members):
            return params
        weight = (1.0 if self.holds_state else 0.0) if holders > 0 else 1.0  # (nobody holds it: all alike)
        averaged, done = self._average_at_switch(self.sync, params, step, "models (end of run)", weight, members)
        self.end_averages += done
        self._note(step, done)
        return averaged

    def resync_state(self, state: torch.Tensor, step: int) -> torch.Tensor:
        """After resync or agree_at_end: the members' mean optimizer state, with the same weights
        (`state` unchanged without a state ring, or if the models were not averaged)."""
        if self.state_sync is None:
            return state
        if self._handed_at == step:
            return self._hand_out(self.state_sync, self.state_handout, state, step, "optimizer states")[0]
        if self._resynced_at != step:
            return state
        return self._average_at_switch(self.state_sync, state, step, "optimizer states", self._weight,
                                       self._averaged_over)[0]

    def _handing_out(self, step: int) -> bool:
        """The view switching at `step` has members that enter (and others that hold the state)."""
        membership = self.comm.membership
        members = membership.members(step)
        entering = set(membership.entering(step)) & set(members)
        return self.rank in members and bool(entering) and len(entering) < len(members)

    def _hand_out(self, ring: RingAllReduce, handout: StateHandout, values: torch.Tensor, step: int,
                  what: str, with_state: bool = False) -> tuple[torch.Tensor, bool]:
        """A switch with entering members: the holders average over their own ring, then hand the
        result (their own values if that failed) to the entering nodes, which wait for it. Whether
        this node now holds the members' state (an average of all holders). `with_state`: the
        optimizer state's hand-out follows (resync_state): the holders send the model with it,
        once both are averaged, so the transfer has the machine alone; an entering node makes
        both landings before it waits."""
        members = self.comm.membership.members(step)
        entering = tuple(m for m in self.comm.membership.entering(step) if m in members)
        holders = tuple(m for m in members if m not in entering)
        if self.rank in entering:
            if with_state and self.state_handout is not None:
                self.state_handout.ready(step, holders)
            # (with the optimizer state's hand-out to follow, its word to the quiet holders covers both)
            taken = handout.take(values, step, holders, self.switch_deadline(len(members)),
                                 notify=not (with_state and self.state_handout is not None))
            if taken is None:
                return values, False
            result, averaged, (began, ended) = taken
            self.received.append((float(values.numel() * values.element_size()), began, ended, step))
            log.info("node %d: members %s from step %d: took the %s of nodes %s from nodes %s%s", self.rank,
                     list(members), step, what, list(holders), list(handout.senders(holders)),
                     "" if averaged else " (they had not all averaged them)")
            return result, averaged
        if len(holders) == 1:  # (a copy: `values` may be the live model, and the sends read what they get)
            given, divisor, done = values.clone(), 1.0, self._weight > 0
        else:
            summed = self._sum_at_switch(ring, values, step, what, self._weight, holders)
            done = summed is not None
            given, divisor = summed if summed is not None else (values.clone(), 1.0)
        # nobody writes to `given` while the sends read it
        if with_state:  # (averaged now, off the transfer's path: the optimizer state's average comes first)
            averaged = given.div_(divisor) if divisor != 1.0 else given
            self._model_handout = (step, handout.outgoing(averaged, holders, done), holders, entering)
            return (averaged if done else values), done
        # sent as sums: the entering nodes divide as this node does, after the transfer, which so
        # starts as soon as the ring ends, on every holder alike
        deadline = self.switch_deadline(len(members))
        outgoing = handout.outgoing(given, holders, done, divisor)  # (its checksum before any slice goes)
        sent = self._send_model_handout(before=step + 1)
        if sent is not None:  # (one after the other, as one stream: a second at once would wait for a new
            self.handout.settle(sent, step, deadline, word=False)  # connection's handshake behind the first)
        handout.settle(handout.send(outgoing, step, entering), step, deadline)
        averaged = given.div_(divisor) if divisor != 1.0 else given
        return (averaged if done else values), done

    def _send_model_handout(self, before: int) -> dict | None:
        """Send the model hand-out kept back for a switch before step `before` (the futures of its
        deliveries); None if none is kept (the optimizer state's hand-out sends it)."""
        kept = self._model_handout
        if kept is None or kept[0] >= before:
            return None
        self._model_handout = None
        step, outgoing, _, entering = kept
        return self.handout.send(outgoing, step, entering)

    def _flush_model_handout(self, before: int) -> None:
        """In case no optimizer state's hand-out came after the model's (resync_state not called):
        the model's goes alone, at the next round."""
        kept = self._model_handout
        sent = self._send_model_handout(before)
        if sent is not None and kept is not None:
            self.handout.settle(sent, kept[0], self.switch_deadline(len(kept[2]) + len(kept[3])), word=False)

    def _note(self, step: int, done: bool) -> None:
        self._resynced_at = step if done else None
        self._apart = not done
        self.holds_state = self.holds_state or done

    def _average_at_switch(self, ring: RingAllReduce, values: torch.Tensor, step: int, what: str,
                           weight: float, members: tuple[int, ...] | None = None) -> tuple[torch.Tensor, bool]:
        """Σ w_i x_i / Σ w_i over `members` (default: those of the view at `step`; one ring call
        over [w x, w]), and whether it was taken; `values` unchanged if not (or if none holds the state)."""
        began = time.monotonic()
        summed = self._sum_at_switch(ring, values, step, what, weight, members)
        if summed is None:
            return values, False
        averaged = summed[0].div_(summed[1])
        if weight == 0:
            self.received.append((float(values.numel() * values.element_size()), began, time.monotonic(), step))
        return averaged, True

    def _sum_at_switch(self, ring: RingAllReduce, values: torch.Tensor, step: int, what: str, weight: float,
                       members: tuple[int, ...] | None = None) -> tuple[torch.Tensor, float] | None:
        """(Σ w_i x_i shaped like `values`, Σ w_i) over `members`, or None when it could not be
        taken (a member missing, none holding the state, or a forged weight)."""
        import torch

        self._weight = weight
        members = members or self.comm.membership.members(step)
        if self.rank not in members or len(members) == 1:
            return None
        flat = values.reshape(-1)
        weighted = torch.empty(flat.numel() + 1, dtype=flat.dtype, device=flat.device)
        torch.mul(flat, weight, out=weighted[:-1])  # (a node with weight 0 sends zeros)
        weighted[-1] = weight
        try:
            summed = ring(weighted, step, average=False, members=members,
                          deadline=self.switch_deadline(len(members)), restore=False)
        except CollectiveIncomplete as exc:
            log.warning("%s; the members' %s were not averaged at their switch", exc, what)
            self.comm.membership.drop_dead_members()
            return None
        total = summed[-1].item()
        if total == 0:
            log.warning("node %d: step %d: no member holds the members' state; the %s were not averaged", self.rank,
                        step, what)
            return None
        if total != round(total) or not 0 < total <= len(members):  # a member sent a forged weight
            log.warning("node %d: step %d: the members' weights sum to %r (of %d members); the %s were not averaged",
                        self.rank, step, total, len(members), what)
            return None
        log.info("node %d: members %s from step %d: %s averaged over the re-formed ring%s", self.rank, list(members),
                 step, what, "" if total == len(members) else f" ({total:.0f} of them hold the state)")
        return summed[:-1].view_as(values), total


def covered_seconds(windows: list[tuple[float, float]]) -> float:
    """The seconds the (start, end) windows cover together (overlaps counted once)."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(windows):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


__all__ = ["REALIGN_AFTER", "MemberRing", "covered_seconds"]
