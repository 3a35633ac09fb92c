"""A ring all-reduce over each step's members, and what its members agree on when those change.

AllReduce-SGD and Pipe-SGD train over it while nodes join, leave or die. At each view switch
(and at the end of the run) the members first all-reduce two numbers each, "holds the members'
state" and the CRC32 of its model: holders with equal models keep their bits, nodes that took a
donor's copy get the holders' state straight from them (fanout.py), and models that differ (rounds
failed or were skipped, or the user started them apart) are averaged, with weight 0 on the takers.
Fault-free nothing changes.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from p2ptrain.algorithms.base import Comm
from p2ptrain.algorithms.collectives import CollectiveIncomplete, RingAllReduce
from p2ptrain.algorithms.fanout import FanOut, FanOutIncomplete, crc32

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

REALIGN_AFTER = 3  # rounds failed in a row before a ring re-forms over the same members


@dataclass(frozen=True)
class SwitchPlan:
    """What the members do at a switch, from their flags (MemberRing._plan_switch):

    - "keep": every member holds the members' state, all with the same model: nothing changes;
    - "mean": models differ and all (or none) hold the state: the plain mean;
    - "weighted": some hold it, with models that differ: Σ w_i x_i / Σ w_i, w_i = holds;
    - "fanout": some hold it, all with the same model: the takers get the holders' bits (FanOut)."""

    how: str
    holders: tuple[int, ...] = ()
    takers: tuple[int, ...] = ()


KEEP = SwitchPlan("keep")
MEAN = SwitchPlan("mean")


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
    - At the first step of a view (Algorithm.members_changed, before the step's round) the members
      agree on a SwitchPlan, with a deadline long enough to wait for the slowest member
      (switch_deadline: paced, and cut short when a member is found dead or dropped): it
      re-aligns the nodes' steps and brings back together models that trained apart while the ring
      was broken, so the members are bit-identical again.
    - A node that took a donor's state since it last agreed (joined, restarted, caught up:
      `holds_state` False) enters with the holders' state as of the switch step (model and
      optimizer state, like torchft's heal), instead of pulling the others back towards its older
      copy.

    `identical_state`: the members' optimizer states are the same bits whenever their models are
    (gradients averaged); otherwise (models averaged, local momentum) they are averaged over the
    holders, never handed out as one holder's."""

    def __init__(self, comm: Comm, numel: int, dtype: torch.dtype | None = None, *, codec=None,
                 resync_deadline: float = 30.0, chunk_bytes: int = 0,
                 state: tuple[int, torch.dtype] | None = None, holds_state: bool = True,
                 identical_state: bool = True):
        import torch  # (here, not at import: the algorithm registry loads without torch)

        self.comm = comm
        self.rank = comm.rank
        self.ring = RingAllReduce(comm, numel, dtype, codec=codec, elastic=True, chunk_bytes=chunk_bytes)
        self.sync = RingAllReduce(comm, numel, dtype, tag="sync.", elastic=True)
        self.fanout = FanOut(comm, numel, self.sync.dtype, tag="sync.")
        # `state`: (numel, dtype) of the optimizer state, agreed on with the model at a switch
        has_state = bool(state and state[0])
        self.state_sync = RingAllReduce(comm, *state, tag="osync.", elastic=True) if has_state else None
        self.state_fanout = FanOut(comm, *state, tag="osync.") if has_state and identical_state else None
        self.resync_deadline = resync_deadline  # the most a switch average waits for a segment (switch_deadline)
        self.flags = RingAllReduce(comm, 2 * comm.world_size, torch.float64, tag="flags.", elastic=True)
        # False from taking a donor's state (a joiner's, a restarted or caught-up node's) until a
        # switch completes: then its state is the members' again
        self.holds_state = holds_state
        self.resyncs = 0  # switches whose plan completed here (stats, tests)
        self.end_averages = 0  # plans other than "keep" completed at the end of the run (stats, tests)
        self._plan: SwitchPlan | None = None  # of the last switch (resync_state follows it)
        self._resynced_at: int | None = None  # the step whose model plan completed (resync_state follows it)
        self._failures = 0  # rounds failed in a row
        self._crc: float | None = None  # of the model at the last switch (its holders' hand-out reuses it)

    def stats(self) -> dict[str, float]:
        """Switches, and the state this node took from holders (MB and seconds, model and optimizer
        state together; bench heal divides them)."""
        taken = [t for fanout in (self.fanout, self.state_fanout) if fanout is not None for t in fanout.received]
        stats = {"ring_resyncs": float(self.resyncs)}
        if taken:
            stats.update(state_received_mb=sum(b for b, _ in taken) / 1e6,
                         state_received_seconds=sum(s for _, s in taken))
        return stats

    @property
    def plan(self) -> SwitchPlan | None:
        """The plan of the last switch (or end of run) this node took part in."""
        return self._plan

    # Rounds ------------------------------------------------------------------------------------
    def reduce_or_keep(self, tensor: torch.Tensor, step: int, *, average: bool = True,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        """The all-reduce over the step's members, or `tensor` unchanged when it cannot complete.
        With `out` the mean is written there and `tensor` is only read (no backup of it is taken)."""
        members = self.members_for(step)
        if members is None:
            return tensor
        try:
            reduced = self.ring(tensor, step, average=average, members=members, out=out)
        except CollectiveIncomplete as exc:
            self.round_failed(exc)
            return tensor
        self.round_completed()
        return reduced

    def members_for(self, step: int) -> tuple[int, ...] | None:
        """The ranks to reduce over at `step`, or None when this step's round is skipped (this node
        alone, not a member, or a member a pending view drops is still in the ring). Rings of
        other tensors that follow the same members (gradient buckets) ask here too."""
        members = self.comm.membership.members(step)
        if self.rank not in members or len(members) == 1:
            return None
        departing = self.comm.membership.departing(step)
        if departing:
            log.info("node %d: step-%d all-reduce skipped: node(s) %s are being dropped from the ring", self.rank,
                     step, sorted(departing))
            return None
        return tuple(members)

    def round_failed(self, exc: CollectiveIncomplete) -> None:
        """A round over members_for(step) could not complete (the caller keeps its local value):
        propose the members without dead peers, and re-form after REALIGN_AFTER failures in a row."""
        log.warning("%s; keeping the local value for this step", exc)
        self.comm.membership.drop_dead_members()
        self._failures += 1
        if self._failures >= REALIGN_AFTER:  # not a dead member (that proposal comes first): re-form
            self._failures = 0
            self.comm.membership.realign()  # (nothing new while a switch is pending)

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
        """At the first step of a view: the members' model by their SwitchPlan (`params`
        unchanged if it cannot complete)."""
        agreed, done = self._agree(self.sync, self.fanout, params, step, "models", at_end=False)
        self.resyncs += done
        return agreed

    def agree_at_end(self, params: torch.Tensor, step: int) -> torch.Tensor:
        """At the end of the run (every member calls it at the same step): if the members' models
        differ (a round was skipped or failed somewhere since the last switch) or a member holds a
        donor's copy, they agree once more (SwitchPlan) and end bit-identical. Otherwise `params` is returned
        untouched: in a fault-free run this costs a CRC of the model and one all-reduce of two
        numbers a node, and changes no bit."""
        agreed, done = self._agree(self.sync, self.fanout, params, step, "models (end of run)", at_end=True)
        self.end_averages += done and self._plan is not KEEP
        return agreed

    def resync_state(self, state: torch.Tensor, step: int) -> torch.Tensor:
        """After resync or agree_at_end: the members' optimizer state by the same plan (`state`
        unchanged without a state ring, or if the models' plan did not complete)."""
        if self.state_sync is None or self._resynced_at != step:
            return state
        plan = self._plan
        if plan.how == "fanout" and self.state_fanout is None:  # unequal states: the holders' mean
            plan = SwitchPlan("weighted", plan.holders, plan.takers)
        return self._carry_out(plan, self.state_sync, self.state_fanout, state, step, "optimizer states")[0]

    def _agree(self, ring: RingAllReduce, fanout: FanOut, values: torch.Tensor, step: int, what: str, *,
               at_end: bool) -> tuple[torch.Tensor, bool]:
        members = self.comm.membership.members(step)
        self._plan = self._resynced_at = None
        if self.rank not in members or len(members) == 1:
            return values, False
        plan = self._plan_switch(step, members, values)
        if plan is None:
            log.warning("node %d: the members' %s may differ%s", self.rank, what, " at the end" if at_end else "")
            return values, False
        agreed, done = self._carry_out(plan, ring, fanout, values, step, what)
        self._plan = plan
        self._resynced_at = step if done else None
        self.holds_state = self.holds_state or done
        return agreed, done

    def _plan_switch(self, step: int, members: tuple[int, ...], values: torch.Tensor) -> SwitchPlan | None:
        """Each member's "holds the state" flag and model CRC, summed over the members (one
        number per rank, so the sums are the values): the plan they all derive alike (None: they
        could not be gathered, nothing is done)."""
        import torch

        n = self.comm.world_size
        flags = torch.zeros(2 * n, dtype=torch.float64)
        flags[self.rank] = 1.0 if self.holds_state else 0.0
        flags[n + self.rank] = self._crc = crc32(values)
        try:
            flags = self.flags(flags, step, average=False, members=members,
                               deadline=self.switch_deadline(len(members)))
        except CollectiveIncomplete as exc:
            log.warning("%s", exc)
            self.comm.membership.drop_dead_members()
            return None
        holders = tuple(r for r in members if flags[r] > 0.5)
        takers = tuple(r for r in members if flags[r] <= 0.5)
        same = len({flags[n + r].item() for r in holders}) <= 1  # the holders' models: one CRC
        if not holders:
            return MEAN
        if not takers:
            return KEEP if same else MEAN
        return SwitchPlan("fanout" if same else "weighted", holders, takers)

    def _carry_out(self, plan: SwitchPlan, ring: RingAllReduce, fanout: FanOut | None, values: torch.Tensor,
                   step: int, what: str) -> tuple[torch.Tensor, bool]:
        """`values` after `plan`, and whether it completed here."""
        if plan.how == "keep":
            return values, True
        members = self.comm.membership.members(step)
        deadline = self.switch_deadline(len(members))
        try:
            if plan.how == "fanout":
                if self.rank in plan.holders:
                    fanout.give(values, step, plan.holders, plan.takers, deadline,
                                whole=self._crc if fanout is self.fanout else None)
                    return values, True
                agreed = fanout.take(values, step, plan.holders, deadline)
                log.info("node %d: step %d: took the members' %s from nodes %s", self.rank, step, what,
                         list(plan.holders))
                return agreed, True
            if plan.how == "mean":
                agreed = ring(values, step, average=True, members=members, deadline=deadline)
            else:  # Σ w_i x_i / Σ w_i, w_i in {0, 1}: a taker sends zeros
                weighted = values * (1.0 if self.rank in plan.holders else 0.0)
                agreed = ring(weighted, step, average=False, members=members, deadline=deadline, restore=False)
                agreed.div_(len(plan.holders))
        except (CollectiveIncomplete, FanOutIncomplete) as exc:
            log.warning("%s; the members' %s were not agreed on at their switch", exc, what)
            self.comm.membership.drop_dead_members()
            return values, False
        log.info("node %d: members %s from step %d: %s averaged over the re-formed ring (%s)", self.rank,
                 list(members), step, what, plan.how)
        return agreed, True


__all__ = ["REALIGN_AFTER", "MemberRing", "SwitchPlan"]
