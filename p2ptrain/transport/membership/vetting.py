"""Whether a view a peer sent may be adopted: views decide who trains, so one node must not be able
to decide it for all. Bounds are checked at once (refusal); what only the named nodes can confirm
(doubts) is asked of them first by greetings.py: a view passed on by a non-proposer is confirmed
with its proposer (gone: with another member holding it), a new member must have greeted this
node (or answer a Hello as itself), and a member that a view drops without its own leave must fail
this node's own probe.

In a fault-free run every view comes from its proposer, names members that greeted everyone, and
drops only its proposer or nodes already dead here: then nothing is asked and nothing changes. A
dropped member that answers the probe as leaving (HelloReply.leaving) left by its own will.
"""
from __future__ import annotations

from dataclasses import dataclass

from p2ptrain.transport.membership.views import View

MAX_EPOCH_STEP = 4096       # a view is at most this many epochs past the latest one held here
MAX_SWITCH_AHEAD = 1 << 20  # ... and switches at most this many steps past the furthest step known


def refusal(view: View, latest: View, furthest_step: int, base: View | None = None) -> str:
    """Why `view` can never be adopted here ("" when it may be): out-of-bound epoch or switch, or
    a switch before that of `base`, the view it names as replaced (Views.named_base, where held):
    a view never switches before a pending one (its newcomers would be members before they enter,
    awaited for a link deadline at steps they never trained), and Views.propose keeps to that."""
    if base is not None and view.switch_step < base.switch_step:
        return (f"switch step {view.switch_step} lies before step {base.switch_step}, the switch of the view it "
                f"replaces ({base.epoch} of node {base.proposer})")
    if view.epoch > latest.epoch + MAX_EPOCH_STEP:
        return f"epoch {view.epoch} jumps more than {MAX_EPOCH_STEP} past ours ({latest.epoch})"
    if view.switch_step > furthest_step + MAX_SWITCH_AHEAD:
        return (f"switch step {view.switch_step} lies more than {MAX_SWITCH_AHEAD} steps past the furthest step "
                f"known here ({furthest_step})")
    return ""


@dataclass(frozen=True)
class Doubts:
    """What must be confirmed before a view is adopted (all empty: adopt it now)."""

    passed_on: bool                 # it came from another node than its proposer
    newcomers: frozenset[int]       # new members that never greeted this node
    dropped_live: frozenset[int]    # members it drops, neither by their own leave nor dead here

    def __bool__(self) -> bool:
        return self.passed_on or bool(self.newcomers) or bool(self.dropped_live)


def doubts(view: View, sender: int, base: View, *, rank: int, announced, live, exact: bool = True) -> Doubts:
    """What `view` (from `sender`) asserts that this node has not seen for itself, against `base`,
    the view it was proposed on top of (Views.named_base, or where this node does not hold that
    one, `exact` False, its own latest view of an earlier epoch: Views.base_of). A concurrent
    proposal that never heard of a node another view admitted does not drop it: against a base
    that is not the proposer's, only the members the view says it drops (View.dropping) are
    dropped. (Compared with our own base, a concurrent admission read as an eviction whenever the
    two lineages differed in epoch; the proposer kept its view, every other node refused it, and
    a 64-node churn run crawled a link deadline a step.) `announced`: ranks that greeted this
    node; `live(ranks)`: those it considers alive and in step."""
    newcomers = set(view.members) - set(base.members) - set(announced) - {rank, view.proposer}
    dropped = (set(base.members) - set(view.members) if exact else set(view.dropping)) - {view.proposer, rank}
    return Doubts(passed_on=view.proposer not in (sender, rank), newcomers=frozenset(newcomers),
                  dropped_live=frozenset(live(sorted(dropped))))


__all__ = ["Doubts", "MAX_EPOCH_STEP", "MAX_SWITCH_AHEAD", "doubts", "refusal"]
