"""The node as its algorithm sees it: the implementation of p2ptrain.algorithms.base.Comm on top of
the node's Transport, plus what the engine needs around it (rejoining, catching up, donors).

Algorithms never open sockets: they call these methods with tensors on their own device, and the
communicator stages them through host memory, speaks the transport's wire enums for them and
turns Acks into Deliveries. It sits between the two layers, so neither imports the other.
"""
from __future__ import annotations

import concurrent.futures
import logging
import time

import torch

from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.algorithms.base import Delivery
from p2ptrain.comm_worker import CommWorker
from p2ptrain.transport.errors import PeerError
from p2ptrain.transport.message import Message
from p2ptrain.transport.runtime import Transport
from p2ptrain.transport.staging import Staging
from p2ptrain.transport.validation import CodecLayout

log = logging.getLogger(__name__)
STATE = pb.MESSAGE_KIND_STATE


class Communicator:
    def __init__(self, transport: Transport, device: torch.device | str = "cpu", peer_timeout: float = 120.0):
        self.transport = transport
        self.rank = transport.rank
        self.world_size = transport.world_size
        self.staging = Staging(device)
        self.peer_timeout = peer_timeout
        self.joining = False        # set before setup: this node (re)joins a running cluster (see wants_membership)
        self.joined: Message | None = None  # the state it got (model, ps-weight, donor's step)
        self.late_states: list[Message] = []  # further states that arrived while rejoining (see fetch_state)
        self.resume_step = 0        # after a (re)join: the step to continue at (>= the donor's step + 1)
        self.wants_membership = True  # stands for itself as a member (a joiner: once set up to receive)
        self.leaving = False          # stands for a view without itself (leave())
        self.drops_dead = False       # stands for views without the peers it declared dead (rings)
        self._worker = CommWorker(f"comm-worker-{self.rank}")  # the engine's, for background collectives

    @property
    def link_deadline(self) -> float:
        """Seconds a message of one step is waited for before its link counts as dropped."""
        return self.transport.options.link_deadline

    def expect(self, kind: int, dtype: torch.dtype, numel: int, *, codecs=None, **kwargs) -> None:
        """Accept `kind` messages of `numel` x `dtype`; `codecs` maps a codec's wire id to its
        (payload bytes, codec params) for this size (the algorithm side knows its codecs)."""
        if codecs is not None:
            codecs = {codec: CodecLayout(*layout) for codec, layout in codecs.items()}
        self.transport.expect(kind, dtype, numel, codecs=codecs, **kwargs)

    def ready(self) -> None:
        """Call after every expect(): announce readiness and wait until all peers are ready too
        (a rejoining node instead tells the live peers it is back and at which step)."""
        self.transport.mark_ready()
        if self.joining:
            self.resume_step = self.transport.announce_ready()
            self.wants_membership = True  # now that it accepts every message it asks to be a member, if new
            self.reconcile_views()
        elif self.world_size > 1:
            self.transport.wait_for_peers(timeout=self.peer_timeout, require_ready=True)

    # Membership and (re)joining -------------------------------------------------------------------
    def live(self, peers: list[int]) -> list[int]:
        """The peers not considered dead or lagging (algorithms neither send to nor wait for them)."""
        return self.transport.membership.live(peers)

    def make_room(self, peer: int, window: int) -> bool:
        """Before sending to `peer`: True once fewer than `window` of our messages to it await their
        Ack. A peer that stays silent a whole link deadline gets a probe (and is declared dead if
        it does not answer); then this returns False and the caller skips it this step. This is
        what keeps a stalled peer from soaking up push-sum mass (or memory) it cannot give back."""
        waiting = self.transport.outstanding(peer)
        if len(waiting) < window:
            return True
        oldest = waiting[:len(waiting) - window + 1]
        concurrent.futures.wait(oldest, timeout=self.transport.options.link_deadline)
        if all(f.done() for f in oldest):
            return True
        log.warning("node %d: node %d acknowledged none of our last %d messages within the link deadline; "
                    "skipping it this step", self.rank, peer, len(waiting))
        self.transport.probe(peer)
        return False

    def all_alive(self) -> bool:
        """No peer is dead or lagging (a collective over all nodes can complete)."""
        membership = self.transport.membership
        return not membership.dead() and not any(membership.lagging(p) for p in membership.peers)

    @property
    def max_lag(self) -> int:
        return self.transport.membership.max_lag

    def lag_report(self) -> str:
        """Why this node must catch up, for logs."""
        membership = self.transport.membership
        return f"excluded by {sorted(membership.excluded_by())}, {membership.behind()} steps behind the cluster"

    def abandon_catch_up(self) -> None:
        """No donor could be had (e.g. the others finished): train on, forgetting who excluded us."""
        self.transport.membership.rejoined()

    def resume_at(self, step: int, timeout: float | None = None) -> None:
        """Continue at `step` (from a checkpoint), and wait until every live peer has got there too:
        a peer still at step 0 would refuse our messages as too far in its future."""
        self.transport.set_step(step)
        self.transport.wait_for_step(step, timeout=self.peer_timeout if timeout is None else timeout)

    def must_catch_up(self) -> bool:
        """A peer declared this node dead (it stalled), or it trails the cluster by more than the
        lag limit: it must rejoin through a state transfer (see DecentralizedTrainer)."""
        return self.transport.membership.must_catch_up()

    def fetch_state(self, numel: int, dtype: torch.dtype, timeout: float | None = None) -> Message:
        """Rejoin: ask a live peer for its model state and wait for it (like hivemind's
        load_state_from_peers). Returns the state; the node resumes at `resume_step` (`state.step +
        1`, or the cluster's step if it has moved on; a restarted node learns it in ready()) as a new
        incarnation, so peers that declared it dead take it back."""
        timeout = self.peer_timeout if timeout is None else timeout
        self.transport.expect(STATE, dtype, numel, preallocate=1)
        self.transport.membership.rejoining()
        deadline = time.monotonic() + timeout
        try:
            while True:
                donor = self.transport.request_state(max(1.0, deadline - time.monotonic()))
                try:
                    messages = self.transport.recv_any(STATE, timeout=min(self.peer_timeout, max(
                        1.0, deadline - time.monotonic())))
                except TimeoutError:
                    if time.monotonic() >= deadline:
                        raise PeerError(f"node {self.rank}: no state from any peer within {timeout:.0f}s") from None
                    log.warning("node %d: donor %d sent no state; asking another peer", self.rank, donor)
                    continue
                state, *late = [self._received(m) for m in messages]
                self.late_states.extend(late)  # an earlier donor answered too: SGP merges that mass as well
                self.joined = state
                donor = state.sender
                self.resume_step = self.transport.rejoined(state.step + 1)
                if self.transport.ready:  # caught up: a member again, if it was dropped
                    self.reconcile_views()
                log.info("node %d: rejoined with node %d's state of step %d (ps-weight %.4g)", self.rank, donor,
                         state.step, state.ps_weight)
                return state
        finally:
            self.transport.unexpect(STATE)  # a state push nobody asked for is refused (the donor keeps it)

    # Elastic membership: views (transport/views.py) -----------------------------------------------
    def members(self, step: int) -> tuple[int, ...]:
        """The ranks that train together at `step` (the topology or the ring is built over them)."""
        return self.transport.views.members_at(step)

    def view_switches_at(self, step: int) -> bool:
        """The members change at `step` (a ring re-forms, and first re-synchronizes the model)."""
        return self.transport.views.switches_at(step)

    def first_step_as_member(self, step: int) -> int | None:
        """The first step >= `step` at which this node is a member (a joiner: the view's switch)."""
        return self.transport.views.first_step_as_member(self.rank, step)

    def first_step_without_me(self, step: int) -> int | None:
        """The first step >= `step` at which this node is no member (a leaver stops before it)."""
        return self.transport.views.first_step_without(self.rank, step)

    def departing(self, step: int) -> frozenset[int]:
        """Members at `step` that the latest view drops and that did not propose it themselves: a
        ring with them cannot complete (they died), so it is not tried until the view switches."""
        latest = self.transport.views.latest
        return frozenset(set(self.members(step)) - set(latest.members) - {latest.proposer})

    def newcomer(self, peer: int) -> bool:
        """`peer` is not a member of the latest view: it joins (or comes back after leaving, or
        after being dropped), and holds no push-sum mass (see Algorithm.welcome)."""
        return self.transport.joining(peer)

    def leave(self) -> None:
        """Propose the members without this node: it trains up to the step before they switch
        (first_step_without_me), then hands over what it holds (Algorithm.hand_over) and stops."""
        self.leaving = True
        self.reconcile_views()

    def drop_dead_members(self) -> None:
        """From now on, propose the members without those this node declared dead (a ring re-forms
        without them; one that rejoins is no longer dead, and proposes itself again)."""
        self.drops_dead = True
        self.reconcile_views()

    def realign(self) -> None:
        """Propose the current members again, unless a switch is pending: a new view over the same
        ranks, at whose switch every ring member averages the model with a long deadline, which
        brings nodes that fell out of step (rounds failing forever) back together."""
        views = self.transport.views
        if views.latest.switch_step <= self.transport.membership.step:
            log.warning("node %d: the ring keeps failing; proposing to re-form it", self.rank)
            self.transport.propose_view(views.latest.members)

    def reconcile_views(self) -> int:
        """Propose the members this node stands for, if the latest view differs: itself in (unless
        it leaves, or must catch up first), itself out when leaving, and with drops_dead the peers
        it declared dead out. What it stands for is state, not a one-off request, so a proposal
        that lost to a concurrent one (same epoch, greater proposer) is made again on top of the
        winner, and nodes with opposite wishes cannot flip-flop (a dead peer that rejoined is no
        longer dead here). Cheap when nothing differs; returns the latest view's switch step."""
        views, membership = self.transport.views, self.transport.membership
        latest = set(views.latest.members)
        out = {self.rank} if self.leaving else set()
        if self.drops_dead:
            out |= set(membership.dead()) & latest
        into = {self.rank} if self.wants_membership and not self.leaving and not membership.must_catch_up() else set()
        target = (latest | into) - out
        if target and target != latest:  # (the last member cannot leave: it trains on)
            self.transport.propose_view(target)
        return views.latest.switch_step

    def state_requests(self) -> list[int]:
        """Peers that asked for this node's state (served by the engine at a step boundary)."""
        return self.transport.take_state_requests() if self.transport.has_state_requests() else []

    def set_step(self, step: int) -> None:
        self.transport.set_step(step)

    def send(self, peer: int, tensor: torch.Tensor, **header) -> concurrent.futures.Future:
        """Push `tensor` to `peer`; the caller must not modify it afterwards. A future of its
        Delivery (the algorithms' view of the peer's Ack)."""
        return _delivery(self.transport.send(peer, self.staging.to_host(tensor), **header))

    def background(self, fn, *args, **kwargs) -> concurrent.futures.Future:
        """Run fn(*args, **kwargs) on this node's communication worker, after every job submitted
        before it (comm_worker.py): how algorithms overlap communication with compute."""
        return self._worker.submit(fn, *args, **kwargs)

    def close(self) -> None:
        """Stop the communication worker (after the transport: a job still waiting then fails)."""
        self._worker.close()

    def recv(self, kind: int, step: int, senders: list[int], *, channel: str = "",
             timeout: float | None = None) -> dict[int, Message]:
        """Wait for each sender's step-`step` message (TimeoutError after the peer timeout)."""
        messages = self.transport.recv(kind, step, senders, channel=channel,
                                       timeout=self.peer_timeout if timeout is None else timeout)
        return {sender: self._received(m) for sender, m in messages.items()}

    def gather(self, kind: int, step: int, senders: list[int], *, channel: str = "",
               deadline: float | None = None) -> dict[int, Message]:
        """The step-`step` messages of the live senders that arrive within the link deadline; a
        missing one counts as a dropped link for this step (see Transport.gather)."""
        messages = self.transport.gather(kind, step, senders, channel=channel, deadline=deadline)
        return {sender: self._received(m) for sender, m in messages.items()}

    def take(self, kind: int, max_step: int, *, channel: str = "") -> list[Message]:
        """Already-arrived messages with step <= max_step (late ones, to be folded in)."""
        return [self._received(m) for m in self.transport.take(kind, max_step, channel)]

    def _received(self, message: Message) -> Message:
        """`message` on the training device: itself on CPU (release() gives its buffer back); on CUDA
        its device copy, whose host buffer the staging releases once the copy is done."""
        tensor = self.staging.to_device(message)
        return message.on_device(tensor) if self.staging.cuda else message


def _delivery(ack: concurrent.futures.Future) -> concurrent.futures.Future:
    """A future of the Delivery that `ack` (a future of the peer's Ack) says."""
    outcome: concurrent.futures.Future = concurrent.futures.Future()

    def settle(done: concurrent.futures.Future) -> None:
        if done.cancelled():
            outcome.cancel()
        elif done.exception() is not None:
            outcome.set_exception(done.exception())
        else:
            reply = done.result()
            outcome.set_result(Delivery(reply.status != pb.Ack.STATUS_REJECTED, reply.reason, reply.detail))

    ack.add_done_callback(settle)
    return outcome
