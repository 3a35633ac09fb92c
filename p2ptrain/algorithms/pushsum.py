"""Push-sum mass of one node (Kempe et al.; seeds 000, 002): the pair (x, w) whose de-biased value
z = x / w converges to the network average, and every rule that keeps Σ_i w_i = n exact.

    push:  keep p x, p w and send (p x, p w) to each out-neighbour,   p = 1 / (out-degree + 1)
    mix:   x += Σ received x-shares,   w += Σ received w-shares;   z = x / w

Invariant: Σ_i w_i = n counting the shares in flight, and with a lossy codec Σ x + Σ residual is
conserved as well (tests/test_fault_tolerance.py's ledger checks the mass). The rules that keep it
are PushSum's, stated once here for SGP and gossip-DiLoCo. Never: a share counted twice or lost, or
one folded in that would make w exceed n. It never picks peers (the caller's graph does), never
decides what x means and never touches the model the engine trains.
"""
from __future__ import annotations

import concurrent.futures
import functools
import logging
import math
import time
from collections import deque
from typing import TYPE_CHECKING, Callable, Iterable

from p2ptrain import compression
from p2ptrain.algorithms.base import Comm, Kind, buffer_like, delivery_failure

if TYPE_CHECKING:
    import torch

LEAVE_POLL_SECONDS = 0.02  # take_over_at_end: how often it looks for a due leaver's mass
FINISH_WAIT_SECONDS = 10.0  # finish(): how long to wait in all for shares that missed their deadline
END_OF_TIME = 1 << 62  # a step past every step: close() takes the shares of any step
PLAUSIBLE_SCALE = 1e4  # a share's de-biased values may exceed ours (or 1) by at most this factor
# Ours is measured every this many steps, not every step (a pass over the model saved on 7 of 8): a
# reference a few steps old is as good against absurd values 10^4 times larger, and honest models
# do not change scale 10^4-fold in a few steps
Z_SCALE_EVERY = 8
SPARE_SHARES = 8  # share buffers kept for reuse once acknowledged (τ + 1 steps of k peers in flight fit)


class PushSum:
    """(x, w) of one node, its shares in flight (`outbox`) and the shares it still waits for.

    What the algorithms built on it (SGP, gossip-DiLoCo) add is what x holds and when they push and
    mix; the mass bookkeeping is here, once:
    - a share is waited for at most the link deadline; one that comes later is folded in at the
      next mix (and awaited once more in finish());
    - the transport retransmits a lost share with the same message id (the receiver drops a
      duplicate), so a share is delivered at most once;
    - a share the receiver definitively refuses, voids when settling, or cannot take because it is
      dead is re-absorbed by the sender; a sent share stays in the outbox until its Ack says which.
      A share whose send failed after bytes left is settled with the receiver before it is
      re-absorbed (the transport asks which it delivered; the rest it voids), so a stalled peer
      that wakes up with our shares in its socket never lets the same mass count twice;
    - a share that would make w exceed n (mass never does) or whose de-biased values are absurd is
      dropped, so a hostile or broken peer cannot poison the model;
    - a member that catches up after a stall gets half of a donor's (x, w), which keeps Σ w and the
      donor's z unchanged, and merges it into its own mass; a fresh process (a joiner, or a node
      restarted after a crash, whose mass went down with it) gets a new unit at the donor's z
      instead, so Σ w stays near the member count however many nodes crash and come back (with
      halves it shrinks by the crashed node's share at every crash: 72 crashes left 0.0009 of 6).
    With a lossy codec a share travels encoded; the sender keeps what the encoding lost in
    `residual` (x units) and re-absorbs the decoded share, so Σ x + Σ residual is conserved as
    well; the residual goes back into x before the next push (error feedback), and whenever x is
    saved or handed over (fold_residual)."""

    def __init__(self, comm: Comm, *, kind: Kind = Kind.PUSH_SUM, channel: str = "",
                 codec: compression.Codec | None = None, log: logging.Logger | None = None):
        self.comm = comm
        self.rank = comm.rank
        self.kind, self.channel = kind, channel
        self.codec = codec if codec is not None and codec.wire_id != compression.UNCOMPRESSED else None
        self.log = log or logging.getLogger(__name__)
        self.x: torch.Tensor | None = None
        self.w = 1.0
        self.residual: torch.Tensor | None = None  # what the codec lost of our shares (x units)
        self.outbox: deque = deque()  # (future of Delivery, x-share, w-share, receiver, step) until acknowledged
        self.refused_shares = 0
        self.dropped_shares = 0   # implausible shares refused at the fold (hostile or broken senders)
        self._z_scale = 1.0       # max |z| of a recent de-biased model, for the plausibility check
        self._debiased = 0        # debias() calls (the scale is measured every Z_SCALE_EVERY of them)
        self.min_w = 1.0          # the smallest w this node ever had (a drained node would show here)
        self.missing: set[tuple[int, int]] = set()  # (sender, step) shares awaited in vain so far
        self.ledger: list[tuple] | None = None  # set to [] to record every mass movement (tests)
        # OUT/node{rank}.mass (train/mass_record.py), so a SIGKILL does not take the record of what was lost
        self.sink = None
        self.in_flight_w = 0.0  # w of the shares in the outbox (sent, not acknowledged)
        self.taken_w = 0.0      # w of every message taken from the inbox (folded, merged, refused)
        self.minted_w = 0.0     # the new units this process started with (a fresh joiner or restart)
        # Every other flow of w, cumulative, for the launcher's exact mass ledger (launcher/verdicts.py):
        # held = started + taken - sent + reabsorbed - retired - dropped, at every moment
        self.started_w = 0.0    # the unit a starting node holds (or a checkpoint's w), not delivered
        self.sent_w = 0.0       # left in shares, splits and the hand-over (welcomes mint: not ours)
        self.reabsorbed_w = 0.0  # shares back that did not get through
        self.retired_w = 0.0    # units retired for leavers (take_over)
        self.dropped_w = 0.0    # taken from the inbox and thrown away (implausible shares, refused leaves)
        self._spare: list[torch.Tensor] = []  # x-sized buffers of acknowledged shares, for the next push
        self.voids_sent = 0  # notices that a share went elsewhere (a view reached us after its switch)

    def expect(self, like: torch.Tensor) -> None:
        """Declare the shares' size (and codec layout); call before comm.ready()."""
        codecs = None
        if self.codec is not None:  # and raw: a share handed on after its sender's end goes as it was decoded
            codecs = {self.codec.wire_id: (self.codec.payload_bytes(like.numel(), like.dtype), self.codec.param_count),
                      compression.UNCOMPRESSED: (like.numel() * like.element_size(), 0)}
        self.comm.expect(self.kind, like.dtype, like.numel(), channel=self.channel or None, codecs=codecs, peak=True,
                         voidable=True)

    def start(self, z: torch.Tensor, weight: float, *, delivered: bool = False) -> torch.Tensor:
        """Hold the mass (weight z, weight) and return z; `delivered`: the weight came in a message
        (a donor's state transfer to this fresh process: a new unit), taken from the inbox."""
        self.w = weight
        self.x = z.detach().clone() * weight
        if self.codec is not None:
            self.residual = self.x.new_zeros(self.x.shape)
        if delivered:
            self.taken_w += weight
            self.minted_w += weight
        else:
            self.started_w += weight
        self.note(-1)
        return self.debias()

    def note(self, step: int, w: float | None = None, in_flight: float | None = None) -> None:
        """Write what this node holds into its mass record (a memcpy into a mapped page); `w` and
        `in_flight` override the current values (a push notes its outcome before the shares leave)."""
        if self.sink is not None:
            self.sink.held(step, self.w if w is None else w, self.in_flight_w if in_flight is None else in_flight,
                           self.taken_w, self.minted_w, self.flows())

    def flows(self) -> tuple[float, float, float, float, float]:
        """(started, sent, reabsorbed, retired, dropped): with taken, what w is made of."""
        return self.started_w, self.sent_w, self.reabsorbed_w, self.retired_w, self.dropped_w

    def stats(self) -> dict[str, float]:
        """What a push-sum node reports: its w, how low it went, shares dropped, in flight, minted."""
        return {"ps_weight": self.w, "min_ps_weight": self.min_w, "dropped_shares": float(self.dropped_shares),
                "ps_in_flight": self.in_flight_w, "ps_minted": self.minted_w}

    def flow_totals(self) -> dict[str, float]:
        """The cumulative flows of w by name, for the launcher's exact mass ledger (the summary's
        `ps_flows`; a killed node's come from its mass record)."""
        started, sent, reabsorbed, retired, dropped = self.flows()
        return {"minted": self.minted_w, "started": started, "taken": self.taken_w, "sent": sent,
                "reabsorbed": reabsorbed, "retired": retired, "dropped": dropped}

    def restore(self, x: torch.Tensor, w: float) -> None:
        """Resume from a checkpoint's (x, w): this process starts with that mass."""
        self.x.copy_(x.to(self.x.device, self.x.dtype))
        self.started_w += float(w) - self.w
        self.w = float(w)
        self.missing.clear()

    # The steps ---------------------------------------------------------------------------------
    def fold_residual(self) -> None:
        """x += what the codec lost of our earlier shares (error feedback; Σ x + Σ residual unchanged)."""
        if self.residual is not None:
            self.x.add_(self.residual)
            self.residual.zero_()

    def push(self, peers: list[int], step: int, update: tuple[torch.Tensor, float] | None = None) -> None:
        """Keep p = 1 / (len(peers) + 1) of (x, w) and send a share p (x, w) to each of `peers`.
        `update` = (model, scale): first x += scale (model - z), z = x / w (the caller's optimizer
        moved its model from z to `model`), fused with the scaling by p. x then holds p x, which is
        both what we keep and every peer's share: x = p (x (1 - scale / w) + scale model) is two
        passes over the model and no temporary, where x += scale (model - z); share = p x;
        x *= p takes seven and a model-sized temporary (on a loaded machine these passes, not the
        arithmetic, are what a push-sum step costs)."""
        p = 1.0 / (len(peers) + 1)  # uniform weights: column i of P^(k), over the peers that take a share
        if update is None:
            self.x.mul_(p)
        else:
            model, scale = update
            self.x.mul_(p * (1.0 - scale / self.w)).add_(model, alpha=p * scale)
        if self.residual is not None:  # what earlier encodings lost goes out now (error feedback)
            self.x.add_(self.residual, alpha=p)
            self.residual.zero_()
        share_w = p * self.w
        encoded = None
        if self.codec is not None and peers:
            encoded = self.codec.encode(self.x)
            decoded = self.codec.decode(encoded.payload, encoded.params, self.x.shape, self.x.dtype)
            self.residual.add_(self.x - decoded, alpha=len(peers))  # lost on the wire, kept here
        # noted before the shares leave: a node killed in between is recorded holding them in flight
        self.sent_w += share_w * len(peers)
        self.note(step, w=share_w, in_flight=self.in_flight_w + share_w * len(peers))
        for peer in peers:
            if encoded is None:  # a buffer per peer, the transport's until its Ack is in (see reabsorb_refused)
                share_x = self._share_buffer()
                share_x.copy_(self.x)
                future = self.comm.send(peer, share_x, kind=self.kind, step=step, ps_weight=share_w,
                                        reliable=True, settle=True, **self._on_channel())
            else:
                share_x = decoded  # re-absorbed as what left, if it does not get through
                future = self.comm.send(peer, encoded.payload, kind=self.kind, step=step, ps_weight=share_w,
                                        reliable=True, settle=True, codec=encoded.codec,
                                        codec_params=encoded.params, dtype=share_x.dtype, numel=share_x.numel(),
                                        shape=tuple(share_x.shape), **self._on_channel())
            self.outbox.append((future, share_x, share_w, peer, step))
            self.in_flight_w += share_w
            self.record("send", step, share_w, peer)
        self.w *= p

    def mix(self, senders: list[int], step: int, now: int,
            senders_now: Callable[[], list[int]] | None = None) -> None:
        """Add the step-`step` shares of `senders` that arrive within the link deadline, and any late
        ones that arrived meanwhile; remember the missing ones (they are folded in later).

        `senders_now`: the senders of step `step` as the views say now. A view adopted during the
        wait that drops one of them (a joiner whose proposal lost to a concurrent one is no member
        at that step after all) ends the wait at once: that share will not come. Without a view
        change it never fires."""
        abandon = None
        if senders_now is not None:
            def abandon() -> str | None:
                gone = set(senders) - set(senders_now())
                return f"node(s) {sorted(gone)} no longer send at step {step} (the members changed)" if gone else None
        arrived = self.comm.gather(self.kind, step, senders, abandon=abandon, **self._on_channel())
        expected = senders if senders_now is None else sorted(set(senders).intersection(senders_now()))
        self.missing.update((s, step) for s in self.comm.membership.live(expected) if s not in arrived)
        self.fold(arrived.values(), now)
        self.fold(self.comm.take(self.kind, step, **self._on_channel()), now)  # shares of earlier steps that came late

    def void(self, peers: Iterable[int], step: int) -> None:
        """Tell `peers` that no step-`step` share of ours is coming: a header-only message of weight
        0 (CODEC_VOID), which ends a receiver's wait for it and is folded in as nothing (see fold).
        No mass moves, and no tensor travels."""
        import torch
        for peer in peers:
            self.comm.send(peer, torch.empty(0, dtype=torch.uint8), kind=self.kind, step=step, ps_weight=0.0,
                           reliable=True, codec=compression.VOID, dtype=self.x.dtype, numel=self.x.numel(),
                           shape=tuple(self.x.shape), **self._on_channel())
            self.voids_sent += 1
            self.record("void", step, 0.0, peer)

    def fold(self, shares, now: int) -> None:
        taken = self.taken_w
        for share in shares:
            if share.ps_weight == 0.0:  # no mass: the sender's notice that its share went elsewhere (void)
                self.missing.discard((share.sender, share.step))
                share.release()
                continue
            self.taken_w += share.ps_weight
            values = self._values(share)
            problem = self.implausible(share, values)
            if problem:
                self.log.error("node %d: dropped node %d's step-%d share: %s", self.rank, share.sender, share.step,
                               problem)
                self.dropped_shares += 1
                self.dropped_w += share.ps_weight
                self.missing.discard((share.sender, share.step))
                share.release()
                continue
            self.x.add_(values.view_as(self.x))
            self.w += share.ps_weight
            self.missing.discard((share.sender, share.step))
            self.record("mix", now, share.ps_weight, share.sender, share.step)
            share.release()
        if self.taken_w != taken:
            self.note(now)

    def implausible(self, share, values: torch.Tensor) -> str:
        """Why a share cannot be honest push-sum mass ("" if it can)."""
        n = self.comm.world_size
        if not 0.0 < share.ps_weight <= n:
            return f"weight {share.ps_weight!r} outside (0, {n}]"
        if self.w + share.ps_weight > n * (1 + 1e-9):
            return f"w would become {self.w + share.ps_weight:.6g} > n = {n} (push-sum mass never exceeds n)"
        peak = share.peak if share.peak is not None and values is share.tensor else _peak_magnitude(values)
        scale = peak / share.ps_weight
        if not math.isfinite(scale) or scale > PLAUSIBLE_SCALE * max(1.0, self._z_scale):
            return f"de-biased values up to {scale:.3g}, ours up to {self._z_scale:.3g}"
        return ""

    def reabsorb_refused(self, now: int) -> None:
        """Re-absorb the shares that did not get through: the receiver refused them, voided them when
        settling, or was dead before they left. Acks may complete in any order (a stalled peer's
        wait while later ones land), so every finished entry is looked at."""
        pending: deque = deque()
        settled = False
        for entry in self.outbox:
            future, share_x, share_w, peer, sent = entry
            if not future.done():
                pending.append(entry)
                continue
            settled = True
            self.in_flight_w -= share_w
            if future.cancelled():
                self.log.warning("node %d: step-%d share for node %d: outcome unknown (send cancelled)", self.rank,
                                 sent, peer)
                continue
            if future.exception() is None and future.result().delivered:
                self._reuse(share_x)
                continue  # accepted, or a duplicate of a retransmission that was accepted
            why = delivery_failure(future)
            self.log.warning("node %d: step-%d share for node %d not delivered (%s); re-absorbing it", self.rank,
                             sent, peer, why)
            self.x.add_(share_x)
            self.w += share_w
            self.reabsorbed_w += share_w
            self.refused_shares += 1
            self.record("reabsorb", now, share_w, peer, sent)
            self._reuse(share_x)
        self.outbox = pending
        if settled:
            if not pending:
                self.in_flight_w = 0.0  # (no rounding left over from the sums)
            self.note(now)

    def _share_buffer(self) -> torch.Tensor:
        """An x-sized buffer for an outgoing share: a spare one if there is, else a new one, so a
        node in its steady state allocates nothing to push."""
        return self._spare.pop() if self._spare else buffer_like(self.x)

    def _reuse(self, share_x: torch.Tensor) -> None:
        """Keep the buffer of a share whose send has finished (the transport reads it no longer)."""
        if len(self._spare) < SPARE_SHARES and share_x.shape == self.x.shape and share_x.dtype == self.x.dtype \
                and share_x.data_ptr() != self.x.data_ptr():
            self._spare.append(share_x)

    def finish(self, unmixed: Iterable[tuple[list[int], int]], last: int) -> torch.Tensor:
        """flush() and close(), then the de-biased model: the end of the run."""
        self.flush(unmixed, last)
        self.close(last + 1)
        for entry in self.outbox:  # unacknowledged at the end: the receiver's, unless it voids them
            entry[0].add_done_callback(functools.partial(self._hand_on_if_refused, entry))
        self.record("w", last + 1, self.w)
        return self.debias()

    def _hand_on_if_refused(self, entry: tuple, future: concurrent.futures.Future) -> None:
        """A share still unacknowledged at our end whose receiver then refused it or voided it when
        settling (it had stalled: its wake-up can answer a Settle before the stuck copy arrives). Our
        run is over, so we cannot re-absorb it: it goes to the same receiver again, as a new message,
        which that receiver, alive since it answered, folds in like any late share. Without it that
        mass was lost. Runs in the thread that completes `future` (the transport's loop)."""
        _, share_x, share_w, peer, sent = entry
        if future.cancelled() or (future.exception() is None and future.result().delivered):
            return
        why = delivery_failure(future)
        if future.exception() is not None:  # our transport stopped first: its outcome stays unknown
            self.log.error("node %d: step-%d share for node %d (w %.4g) unsettled at our end (%s)", self.rank,
                           sent, peer, share_w, why)
            return
        self.log.warning("node %d: step-%d share for node %d (w %.4g) refused after our end (%s); sending it "
                         "again as a new message", self.rank, sent, peer, share_w, why)
        again = self.comm.send(peer, share_x, kind=self.kind, step=sent, ps_weight=share_w, reliable=True,
                               even_if_dead=True, **self._on_channel())
        again.add_done_callback(functools.partial(self._report_lost, share_w, peer, sent))

    def _report_lost(self, share_w: float, peer: int, sent: int, future: concurrent.futures.Future) -> None:
        if not future.cancelled() and future.exception() is None and future.result().delivered:
            return
        self.log.error("node %d: step-%d share for node %d lost after our end: w %.4g (%s)", self.rank, sent, peer,
                       share_w, delivery_failure(future))

    def flush(self, unmixed: Iterable[tuple[list[int], int]], last: int) -> None:
        """Receive the shares still in flight (`unmixed`: (senders, step) not mixed yet, and earlier
        ones that missed their deadline) so no mass is left on the wire; wait for every ack
        (re-absorbing refusals). What it receives is booked at step last + 1. Also before a
        checkpoint, when the run goes on after it."""
        after = last + 1
        for senders, step in unmixed:
            self.mix(senders, step, after)
        # A live sender's share does come (it is re-sent until acknowledged, or re-absorbed only if
        # the sender thinks we are dead): worth a longer wait than one step's deadline.
        budget = min(self.comm.peer_timeout, max(self.comm.link_deadline, FINISH_WAIT_SECONDS))
        end = time.monotonic() + budget  # one budget for all of them
        for sender, step in sorted(self.missing, key=lambda m: m[1]):
            if (sender, step) in self.missing:
                wait = max(0.0, end - time.monotonic())
                self.fold(self.comm.gather(self.kind, step, [sender], deadline=wait, **self._on_channel()).values(),
                          after)
        self.fold(self.comm.take(self.kind, last, **self._on_channel()), after)
        concurrent.futures.wait([entry[0] for entry in self.outbox], timeout=max(0.0, end - time.monotonic()))
        self.reabsorb_refused(after)
        if self.outbox:  # their receivers stalled or died and never settled: that mass is theirs now
            self.log.warning("node %d: %d share(s) (w %.4g in all) still unacknowledged at the end", self.rank,
                             len(self.outbox), sum(entry[2] for entry in self.outbox))

    def close(self, now: int) -> None:
        """The end of the run, after flush(): refuse shares from now on, then fold in every one
        delivered before that, of any step. A sender that did not expect us to be done (a view
        it held gave it an edge to us that ours did not) then re-absorbs its share, instead of
        its share landing in an inbox nobody reads: that mass was lost under churn."""
        self.comm.unexpect(self.kind, self.channel or None)
        self.fold(self.comm.take(self.kind, END_OF_TIME, **self._on_channel()), now)

    def merge(self, state, now: int, x_share: torch.Tensor | None = None, *, new_unit: bool = False) -> torch.Tensor:
        """Merge a donor's half (x_d / 2, w_d / 2) into our own (x, w): sent as z_d with weight
        w_d / 2 (or, where the state carries a model that is not z, as `x_share`). Σ w is conserved
        and z moves to the weighted mean. `new_unit`: a second donor answered a fresh process's
        request (welcome): a unit it minted, counted as such."""
        if x_share is None:
            self.x.add_(state.tensor.view_as(self.x), alpha=state.ps_weight)
        else:
            self.x.add_(x_share)
        self.w += state.ps_weight
        self.taken_w += state.ps_weight
        if new_unit:
            self.minted_w += state.ps_weight
        self.note(now)
        self.missing.clear()  # shares of steps before the rejoin: the senders had excluded us
        self.record("mix", now, state.ps_weight, state.sender, state.step)
        state.release()
        return self.debias()

    def split(self, peer: int, step: int, model: torch.Tensor | None = None) -> torch.Tensor:
        """Give a (re)joining peer half of (x, w): Σ w is conserved and both keep this node's z. It is
        sent as a model to load: z itself, or `model` where the caller's model is not z."""
        share_x, share_w = self.x * 0.5, self.w * 0.5
        sent = share_x / share_w if model is None else model.detach().clone()
        self.sent_w += share_w
        self.note(step, w=share_w, in_flight=self.in_flight_w + share_w)
        future = self.comm.send(peer, sent, kind=Kind.STATE, step=step, ps_weight=share_w, reliable=True,
                                settle=True)
        self.outbox.append((future, share_x, share_w, peer, step))
        self.in_flight_w += share_w
        self.x.mul_(0.5)
        self.w *= 0.5
        self.record("send", step, share_w, peer)
        return self.debias()

    # Elastic membership: a node joins with a new unit of mass, a leaving node's unit is retired ---
    def welcome(self, peer: int, step: int, model: torch.Tensor | None = None) -> None:
        """Give a fresh process (a node that joins, or one restarted after a crash) one new unit of
        mass at our z (or at `model`): it starts with (z, 1) as its (x, w), so Σ w grows by one
        with the member count (or makes up for the mass that went down with the crashed node) and
        our own mass stays. If it never arrives the unit never existed: nothing to re-absorb."""
        sent = (self.z if model is None else model).detach().clone()
        self.comm.send(peer, sent, kind=Kind.STATE, step=step, ps_weight=1.0, reliable=True)
        self.record("create", step, 1.0, peer)

    def hand_over(self, members: list[int], step: int) -> bool:
        """This node leaves: send its whole (x, w) to the first of `members` that takes it (a
        LEAVE message of step `step`, the first the node does not run); True once one did. The
        receiver retires one unit (take_over), so Σ w stays the member count. Each send is settled
        (delivered, or voided: a late copy is refused) before the next member is tried, so the
        mass never lands twice; a member that does not answer within the peer timeout in all (it
        is frozen: the outcome is unknown) ends the hand-over, and the mass may still reach it.
        First it stops taking other leavers' mass (it would leave with us: they try another member)
        and absorbs what came before, retiring a unit for each, as a member does."""
        self.comm.unexpect(Kind.LEAVE)
        self.take_over(step)
        self.fold_residual()
        end = time.monotonic() + max(self.comm.peer_timeout, 2 * self.comm.link_deadline)
        for peer in members:
            future = self.comm.send(peer, self.x.detach().clone(), kind=Kind.LEAVE, step=step, ps_weight=self.w,
                                    reliable=True, settle=True)
            try:
                delivery = future.result(timeout=max(0.0, end - time.monotonic()))
            except concurrent.futures.TimeoutError:
                self.log.error("node %d: node %d has not settled our mass (w %.4g) within the peer timeout: it "
                               "leaves with us unless that node takes it late", self.rank, peer, self.w)
                return False
            except Exception as exc:  # noqa: BLE001 - nothing was sent (the peer was dead): the next member
                self.log.warning("node %d: node %d did not take our mass (%s)", self.rank, peer, exc)
                continue
            if delivery.delivered:
                self.record("send", step, self.w, peer)
                self.sent_w += self.w
                self.x.zero_()
                self.w = 0.0
                self.note(step)
                self.record("w", step, 0.0)
                return True
            self.log.warning("node %d: node %d refused our mass: %s", self.rank, peer, delivery.reason)
        self.log.error("node %d: no member took our push-sum mass (w %.4g): it leaves with us", self.rank, self.w)
        return False

    def take_over_at_end(self, now: int) -> None:
        """The run is over here: wait (at most the link deadline) for the mass of the leavers whose
        hand-over tries this node first (Membership.leaves_due: a leave that switched a few steps
        before the end found every member finished), then refuse LEAVE messages from now on and
        absorb those that came. A leaver that picks this node later hands its mass to a member
        still training (its mass sat in an inbox nobody read once: Σ w of a 64-node churn run came
        out one short)."""
        membership = self.comm.membership
        end = time.monotonic() + self.comm.link_deadline
        self.take_over(now)
        while membership.leaves_due(now) and time.monotonic() < end:
            time.sleep(LEAVE_POLL_SECONDS)
            self.take_over(now)
        self.comm.unexpect(Kind.LEAVE)
        self.take_over(now)

    def take_over(self, now: int) -> None:
        """Absorb the whole mass of nodes that left (LEAVE messages), then retire one unit of it at
        our z (what the leaver counted as one member): Σ w stays the member count. A unit is retired
        only as far as w stays at least a quarter of its value, so w never nears 0."""
        for share in self.comm.take(Kind.LEAVE, 2 ** 62):
            if self.comm.membership.accept_leave(share.sender, share.ps_weight):
                self.taken_w += share.ps_weight  # (taken from the inbox, held by nobody)
                self.dropped_w += share.ps_weight
                continue  # not a member that leaves, a second hand-over, or more mass than there is
            at, sender, before = max(now, share.step), share.sender, self.w
            self.fold([share], at)
            if self.w <= before:  # dropped as implausible: nothing absorbed, nothing to retire
                continue
            retired = min(1.0, 0.75 * self.w)
            if retired < 1.0:
                self.log.warning("node %d: retired %.4g instead of 1 unit of mass for node %d (w %.4g)", self.rank,
                                 retired, sender, self.w)
            self.retired_w += retired
            self.note(at, w=self.w - retired)  # (first: the retired unit is no longer anyone's)
            self.x.mul_(1.0 - retired / self.w)
            self.w -= retired
            self.record("retire", at, retired, sender)

    def record(self, event: str, step: int, weight: float, peer: int = -1, sent: int = -1) -> None:
        if self.ledger is not None:
            self.ledger.append((event, step, weight, peer, sent))

    @property
    def z(self) -> torch.Tensor | None:
        """x / w, computed afresh (debias() hands the step's z to the caller's model instead)."""
        return None if self.x is None else self.x / self.w

    def debias(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """z = x / w, written into `out` (the caller's model: no copy afterwards) or a new tensor."""
        import torch
        self.min_w = min(self.min_w, self.w)
        z = self.x / self.w if out is None else torch.div(self.x, self.w, out=out)
        if self._debiased % Z_SCALE_EVERY == 0:
            self._z_scale = _peak_magnitude(z)
        self._debiased += 1
        return z

    def _values(self, share) -> torch.Tensor:
        """A share's x-values, decoded when it travelled encoded."""
        if share.codec == compression.UNCOMPRESSED:
            return share.tensor
        return compression.get_codec(share.codec).decode(share.tensor, share.codec_params, (share.tensor.numel(),)
                                                         if self.x is None else tuple(self.x.shape), self.x.dtype)

    def _on_channel(self) -> dict:
        return {"channel": self.channel} if self.channel else {}


def _peak_magnitude(values: torch.Tensor) -> float:
    from p2ptrain.transport.validation import peak_magnitude  # (imports torch: not at module level)

    return peak_magnitude(values)


__all__ = ["FINISH_WAIT_SECONDS", "PLAUSIBLE_SCALE", "PushSum", "Z_SCALE_EVERY"]
