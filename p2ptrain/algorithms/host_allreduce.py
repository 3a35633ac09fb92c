"""All-reduce through one host's shared memory: the members of a ring that all run on one host sum
their tensors in each other's regions (Comm.host_region), with no message per segment.

Each member i writes its input into its region D_i and publishes (step, WRITTEN); once every member
has, it sums its segment over the members' D_j, in member order, into its region's result R_i and
publishes (step, REDUCED); each member then copies every R_j into its output. Every member ends with
the same bits, as on the ring. Members agree to use regions once per member set, over the ring
(their offers, then whether each mapped all the others'), and go back to the ring where any cannot.
"""
from __future__ import annotations

import logging
import time
import zlib
from typing import TYPE_CHECKING

from p2ptrain import compression
from p2ptrain.algorithms.base import Comm
from p2ptrain.algorithms.collectives import CollectiveIncomplete, RingAllReduce, ring_order, segment_bounds

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# What a member publishes: (mark, key, reduced step, its key). mark = step * PHASES + phase: WRITING
# comes before its input changes (a reader that sees the mark move knows what it read may be torn),
# ABANDONED when it gave the step up, AGREEING while it agrees again (a member that still holds an
# older agreement joins in). Its result R stays until every member wrote a later step, so "reduced"
# (step and key of the last R) outlives the mark: a member may go on before the others copied R.
WRITING, WRITTEN, REDUCED, ABANDONED, AGREEING = range(5)
PHASES = 8
UNREADABLE = (-1, 0, -1, 0)  # what a region reads as while its words cannot be read (a peer killed mid-store)
OFFER_FIELDS = 3  # pid, fd, nonce
MAX_BYTES = 1 << 30  # larger tensors stay on the ring: a region holds 1.5 copies of the tensor
POLL_SECONDS = 0.1  # how often a wait looks at the membership (why waiting is hopeless), between wake-ups
HOST_MEMORY_HELP = ("where every member runs on this host, each step's all-reduce sums the members' tensors in "
                    "shared memory (no message per segment; host_allreduce.py); off: the ring's messages always")


def members_key(members: tuple[int, ...]) -> int:
    """What a member publishes to say which members it reduces over (never the zeros of a fresh region)."""
    return zlib.crc32(bytes(str(members), "ascii")) | 1 << 32


class AgreeAgain(Exception):
    """A member agrees again at this step (it failed a call this node kept its agreement through)."""


class HostAllReduce:
    """`ring`'s all-reduce, over shared memory where every member of the call runs on this host and
    all agreed to (otherwise, and on other platforms, `ring` itself). The same call and failure
    contract as RingAllReduce.__call__: the mean or sum in `out` (or in place), CollectiveIncomplete
    with the input untouched when a member gives the step up, dies or misses the link deadline."""

    def __init__(self, comm: Comm, ring: RingAllReduce, *, tag: str = "host."):
        import torch  # (here, not at import: the algorithm registry loads without torch)

        self.comm, self.ring = comm, ring
        self.rank, self.numel, self.dtype = comm.rank, ring.numel, ring.dtype
        self.result_numel = -(-self.numel // 2)  # the largest segment of a ring of two or more
        self.nbytes = (self.numel + self.result_numel) * self.dtype.itemsize
        self.usable = (ring.codec.wire_id == compression.UNCOMPRESSED and self.nbytes <= MAX_BYTES
                       and comm.world_size > 1)
        n = comm.world_size
        if self.usable:  # agreement rings, declared now (before comm.ready())
            self.offers = RingAllReduce(comm, OFFER_FIELDS * n, torch.float64, tag=f"{tag}o.", elastic=True)
            self.mapped = RingAllReduce(comm, n, torch.float64, tag=f"{tag}m.", elastic=True)
        self.region = None  # this node's OwnRegion, made at the first agreement
        self._peers: dict[int, tuple[tuple[int, int, int], object]] = {}  # rank -> (offer, PeerRegion)
        self._agreed: dict[tuple[int, ...], bool] = {}
        self._agreed_at = -1  # the step of the last agreement
        self._failed = False  # the last call failed: the next waits m link deadlines for its first mark
        self.rounds = 0  # calls completed through shared memory (stats, tests)

    def __call__(self, tensor: torch.Tensor, step: int, *, average: bool = True, members=None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        if members is None or not self.usable:
            return self.ring(tensor, step, average=average, members=members, out=out)
        members = ring_order(members, self.comm.membership.placed(step))
        if len(members) < 2 or not self._agree(members, step):
            return self.ring(tensor, step, average=average, members=members, out=out)
        try:
            try:
                result = self._reduce(tensor, step, average, members, tensor if out is None else out)
            except AgreeAgain:  # (a member failed a call this node did not take part in)
                self._agreed.pop(members, None)
                if not self._agree(members, step):
                    return self.ring(tensor, step, average=average, members=members, out=out)
                result = self._reduce(tensor, step, average, members, tensor if out is None else out)
        except CollectiveIncomplete:
            self._agreed.pop(members, None)  # agree again first: a member may have gone back to the ring
            self._failed = True
            raise
        self._failed = False
        self.rounds += 1
        return result

    # Agreement --------------------------------------------------------------------------------------
    def _agree(self, members: tuple[int, ...], step: int) -> bool:
        """Whether `members` reduce through shared memory: decided once per member set by two small
        all-reduces on the ring (each member's offer, then whether each mapped all the others'),
        whose bits every member gets alike, so they all decide alike. Raises CollectiveIncomplete
        (the call fails, as a ring call would) when those cannot complete."""
        import torch

        if members in self._agreed:
            return self._agreed[members]
        hosts = {self.comm.host(member) for member in members}
        if len(hosts) != 1 or "" in hosts:  # (every node derives this from the same addresses)
            self._agreed[members] = False
            return False
        if self.region is None:
            self.region = self.comm.host_region(self.nbytes) or False
        if self.region:
            self.region.publish(step * PHASES + AGREEING, members_key(members))
        n = self.comm.world_size
        offers = torch.zeros(OFFER_FIELDS * n, dtype=torch.float64)
        if self.region:
            offers[OFFER_FIELDS * self.rank:OFFER_FIELDS * (self.rank + 1)] = torch.tensor(
                self.region.offer, dtype=torch.float64)
        offers = self.offers(offers, step, average=False, members=members)
        mapped = bool(self.region) and all(self._map(peer, offers[OFFER_FIELDS * peer:OFFER_FIELDS * (peer + 1)])
                                           for peer in members if peer != self.rank)
        flags = torch.zeros(n, dtype=torch.float64)
        flags[self.rank] = 1.0 if mapped else 0.0
        flags = self.mapped(flags, step, average=False, members=members)
        agreed = all(flags[member] == 1.0 for member in members)
        self._agreed[members] = agreed
        self._agreed_at = step
        log.info("node %d: members %s all-reduce %s", self.rank, list(members),
                 "through this host's shared memory" if agreed else "on the ring (a member cannot map the others)")
        return agreed

    def _map(self, peer: int, fields: torch.Tensor) -> bool:
        offer = tuple(int(value) for value in fields.tolist())
        if not offer[0]:
            return False
        known = self._peers.get(peer)
        if known is not None and known[0] == offer:
            return True
        try:
            self._peers[peer] = (offer, self.comm.map_host_region(offer, self.nbytes))
        except ValueError as exc:
            log.info("node %d: node %d's shared memory cannot be mapped here: %s", self.rank, peer, exc)
            self._peers.pop(peer, None)
            return False
        return True

    # The collective ---------------------------------------------------------------------------------
    def _reduce(self, tensor: torch.Tensor, step: int, average: bool, members: tuple[int, ...],
                out: torch.Tensor) -> torch.Tensor:
        from p2ptrain.transport.validation import all_finite  # (lazily: the transport's helper needs torch)

        key = members_key(members)
        own, m = self.region, len(members)
        mine, result = self._data(own), self._data(own, result=True)
        own.publish(step * PHASES + WRITING, key, wake=False)  # (readers of the data before: it changes now)
        mine.copy_(tensor.view(-1))
        own.publish(step * PHASES + WRITTEN, key)
        regions = {peer: self._peers[peer][1] for peer in members if peer != self.rank}
        try:
            first = self.comm.link_deadline * (m if self._failed else 1)
            for peer in regions:
                self._await(regions[peer], peer, members, step, WRITTEN, key, first)
            position = members.index(self.rank)
            a, b = segment_bounds(self.numel, m)[position]
            own.publish(step * PHASES + WRITTEN, key, -1, 0, wake=False)  # (R changes now: see _copied)
            total = result[:b - a]
            for i, member in enumerate(members):
                values = mine[a:b] if member == self.rank else self._data(regions[member])[a:b]
                total.copy_(values) if i == 0 else total.add_(values)
            for peer in regions:  # what was read is what they wrote for this step (not torn by a new one)
                self._still(regions[peer], peer, step)
            if average:
                total.div_(m)
            if not all_finite(total):
                raise CollectiveIncomplete(f"node {self.rank}: step-{step} host all-reduce: a member's values "
                                           "hold NaN or Inf")
            own.publish(step * PHASES + REDUCED, key, step, key)
            flat = out.view(-1)
            for member, (a, b) in zip(members, segment_bounds(self.numel, m)):
                if member == self.rank:
                    flat[a:b].copy_(total)
                    continue
                self._await(regions[member], member, members, step, REDUCED, key, self.comm.link_deadline)
                flat[a:b].copy_(self._data(regions[member], result=True)[:b - a])
                self._copied(regions[member], member, step, key)
            if not all_finite(flat):  # (a member may rewrite its result after checking it)
                raise CollectiveIncomplete(f"node {self.rank}: step-{step} host all-reduce: a member's sum "
                                           "holds NaN or Inf")
        except CollectiveIncomplete:
            own.publish(step * PHASES + ABANDONED, key)
            if out is tensor:
                tensor.view(-1).copy_(mine)
            raise
        return out

    def _data(self, region, *, result: bool = False) -> torch.Tensor:
        split = self.numel * self.dtype.itemsize
        return (region.data[split:] if result else region.data[:split]).view(self.dtype)

    def _await(self, region, peer: int, members: tuple[int, ...], step: int, phase: int, key: int,
               deadline: float) -> None:
        """Until `peer` published `phase` of this step: its input (WRITTEN, which holds until we
        publish our sum) or its sum (REDUCED, which holds until we write a later step). A peer
        still before that which moves gets another deadline (it comes level: a node behind gives
        each step up as soon as it sees a member past it); raises CollectiveIncomplete when it
        gave the step up or went past it without, reduces over other members, dies or is silent
        a whole deadline."""
        seen, limit = None, time.monotonic() + deadline
        while True:
            generation = region.generation()
            mark, their_key, reduced, reduced_key = (region.read() or UNREADABLE)[:4]
            at, their_phase = divmod(mark, PHASES)
            if phase == REDUCED and (reduced, reduced_key) == (step, key):
                return
            if at == step and their_key == key and phase <= their_phase < ABANDONED:
                return
            if at == step and their_key == key and their_phase == AGREEING and self._agreed_at < step:
                raise AgreeAgain()
            if at > step or (at == step and (their_phase == ABANDONED or (their_key != key and their_phase))):
                raise CollectiveIncomplete(f"node {self.rank}: step-{step} host all-reduce: node {peer} "
                                           + ("went on to step %d" % at if at > step else
                                              "gave the step up" if their_phase == ABANDONED else
                                              "reduces over other members"))
            now = time.monotonic()
            if mark != seen:
                seen, limit = mark, max(limit, now + deadline) if seen is not None else limit
            reason = self.ring.hops.hopeless(members, peer, step, [])
            if reason is not None:
                raise CollectiveIncomplete(f"node {self.rank}: step-{step} host all-reduce not awaited: {reason}")
            if now >= limit:
                raise CollectiveIncomplete(f"node {self.rank}: step-{step} host all-reduce: node {peer} missed the "
                                           "link deadline")
            region.wait(generation, min(limit - now, POLL_SECONDS))

    def _settled(self, region) -> tuple[int, ...]:
        """The region's words, waiting (a link deadline at most) for an owner that was preempted
        between the stores of a publication; UNREADABLE if it never finishes it (killed there)."""
        limit = time.monotonic() + self.comm.link_deadline
        while True:
            generation = region.generation()
            words = region.read()
            if words is not None:
                return words
            remaining = limit - time.monotonic()
            if remaining <= 0:
                return UNREADABLE
            region.wait(generation, min(remaining, POLL_SECONDS))

    def _copied(self, region, peer: int, step: int, key: int) -> None:
        """`peer`'s sum was not rewritten while it was copied (it starts a new one only once every
        member wrote a later step: with the same members never before this node's; with others, at
        a view this node did not take)."""
        if tuple(self._settled(region)[2:4]) != (step, key):
            raise CollectiveIncomplete(f"node {self.rank}: step-{step} host all-reduce: node {peer} rewrote its "
                                       "sum while it was copied")

    def _still(self, region, peer: int, step: int) -> None:
        """`peer` has not given this step up (nor gone on): the input read from it is this step's."""
        at, their_phase = divmod(self._settled(region)[0], PHASES)
        if at != step or not WRITTEN <= their_phase < ABANDONED:
            raise CollectiveIncomplete(f"node {self.rank}: step-{step} host all-reduce: node {peer} rewrote its "
                                       "input while it was read")


__all__ = ["HostAllReduce", "HOST_MEMORY_HELP", "MAX_BYTES"]
