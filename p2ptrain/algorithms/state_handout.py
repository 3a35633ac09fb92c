"""The members' state handed straight to the nodes that enter a ring at a view switch.

A node new in a view (View.entering: a restarted or joining node) holds a donor's copy of an earlier
step. At the switch the other members, the holders, average among themselves; then the first holder
on each host sends its host's slice of the result to every entering node, the hosts in parallel,
point to point (over the TCP lane where there is one); the other holders there wait, quiet, until the
entering node says it took it (holders on one host share its CPUs and network: parallel streams from
one host only compete). So an entering node starts the switch step with the members' state bit for
bit. Each slice says whether the holders' average completed and carries a checksum of its bits; a
slice that is missing or wrong leaves the entering node with its donor's copy, marked apart, so that
the next switch or the end of the run averages it in (with weight 0: MemberRing).
"""
from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import TYPE_CHECKING, NamedTuple

from p2ptrain import compression
from p2ptrain.algorithms.base import delivery_failure
from p2ptrain.algorithms.collectives import KIND, CollectiveIncomplete, RingHops

if TYPE_CHECKING:
    import torch

    from p2ptrain.algorithms.base import Comm

log = logging.getLogger(__name__)

WORD_BITS = 52  # a checksum travels as two codec params (doubles, exact below 2^53): its low and high bits
SETTLE_POLL = 0.1  # seconds between looks for dead entering nodes while a holder waits for its sends
ALIGN_BYTES = 64  # slices start at multiples of this, so that their 64-bit words can be read in place


def checksum(values: torch.Tensor) -> tuple[float, float]:
    """The wrapping sum (mod 2^64) of `values`' 64-bit words counted from its first byte, plus its
    last bytes weighted by position, split into two exact doubles: one cheap pass (0.3 ms for
    21 MB) that any single flipped bit changes."""
    import torch

    raw = values.reshape(-1).view(torch.uint8)
    whole = raw.numel() // 8 * 8
    words = raw[:whole] if raw.storage_offset() % 8 == 0 else raw[:whole].clone()  # (a view needs alignment)
    total = int(words.view(torch.int64).sum()) if whole else 0
    total += sum(byte * (i + 1) for i, byte in enumerate(raw[whole:].tolist()))
    total %= 1 << 64
    return float(total & ((1 << WORD_BITS) - 1)), float(total >> WORD_BITS)


def slice_bounds(numel: int, parts: int, itemsize: int) -> list[tuple[int, int]]:
    """[a, b) of each holder's slice: equal parts, each starting at a multiple of ALIGN_BYTES
    (the ends may hold fewer, or none)."""
    align = max(1, ALIGN_BYTES // itemsize)
    edges = [0] + [min(numel, -(-(numel * i // parts) // align) * align) for i in range(1, parts)] + [numel]
    return list(zip(edges[:-1], edges[1:]))


class Outgoing(NamedTuple):
    """A holder's slice of a hand-out, ready to go: its values, channel and header params (None: a quiet holder)."""

    piece: torch.Tensor | None
    channel: str
    params: tuple[float, ...]


class StateHandout:
    """Hand a flat state of `numel` x `dtype` from the holders to the entering nodes of a switch;
    declare before comm.ready(). A channel per number of senders and slice, so that every slice
    arrives with its exact size; `tag` keeps the model's and the optimizer state's apart."""

    def __init__(self, comm: Comm, numel: int, dtype: torch.dtype, *, tag: str):
        self.comm, self.rank = comm, comm.rank
        self.numel, self.dtype, self.tag = numel, dtype, tag
        self.hops = RingHops(comm, KIND, elastic=True, what="state hand-out")
        self._ready: tuple[int, tuple[int, ...], torch.Tensor] | None = None  # ready(): (step, holders, landing)
        for holders in range(1, comm.world_size):
            for index, (a, b) in enumerate(slice_bounds(numel, holders, dtype.itemsize)):
                if b > a:  # raw values; (averaged, divisor, checksum's low and high bits) in the codec params
                    comm.expect(KIND, dtype, b - a, channel=self._channel(holders, index),
                                codecs={compression.UNCOMPRESSED: ((b - a) * dtype.itemsize, 4)}, preallocate=0)
        self.notice_channel = f"{tag}taken"  # an entering node to the holders that did not send: 1 took it, 0 not
        comm.expect(KIND, dtype, 1, channel=self.notice_channel)

    def senders(self, holders: tuple[int, ...]) -> tuple[int, ...]:
        """The holders that send a slice: the first of each host (a holder of unknown host is its own)."""
        first: dict[str, int] = {}
        for holder in holders:
            first.setdefault(self.comm.host(holder) or f"#{holder}", holder)
        return tuple(first.values())

    def _bounds(self, senders: tuple[int, ...]) -> list[tuple[int, int]]:
        return slice_bounds(self.numel, len(senders), self.dtype.itemsize)

    def _channel(self, holders: int, index: int) -> str:
        return f"{self.tag}{holders}.{index}"

    def outgoing(self, values: torch.Tensor, holders: tuple[int, ...], averaged: bool,
                 divisor: float = 1.0) -> Outgoing:
        """This holder's slice of `values` (which nobody writes to until settle(): the sends read
        it) with its header: whether the holders' average completed, the `divisor` the entering
        node divides it by once taken (sums go as soon as a ring ends) and its checksum, taken
        here, before any of a switch's slices go out (not while they do). No slice on a quiet
        holder (another of its host sends)."""
        senders = self.senders(holders)
        if self.rank not in senders:
            return Outgoing(None, "", ())
        index = senders.index(self.rank)
        a, b = self._bounds(senders)[index]
        piece = values.reshape(-1)[a:b]
        params = (1.0 if averaged else 0.0, divisor, *checksum(piece))
        return Outgoing(piece, self._channel(len(senders), index), params)

    def send(self, outgoing: Outgoing, step: int,
             entering: tuple[int, ...]) -> dict[int, concurrent.futures.Future | None]:
        """Send an outgoing() slice to every entering node: the futures of its deliveries by
        entering node; None for each on a quiet holder (settle() then awaits the node's word)."""
        piece = outgoing.piece
        if piece is None:
            return dict.fromkeys(entering)
        if not piece.numel():
            return {}
        return {peer: self.comm.send(peer, piece, kind=KIND, step=step, channel=outgoing.channel,
                                     codec=compression.UNCOMPRESSED, codec_params=outgoing.params, dtype=self.dtype,
                                     numel=piece.numel(), shape=(piece.numel(),), reliable=True)
                for peer in entering}

    def settle(self, sends: dict[int, concurrent.futures.Future | None], step: int, deadline: float, *,
               word: bool = True) -> None:
        """Wait until the entering nodes took what send() sent, or (None) say they took their
        slices from the other holders (at most `deadline` seconds, and not for a node found dead):
        the transfer then has the machine to itself, and the ring's next round starts with every
        member there, which from `step` awaits each that took it. `word` False: a quiet holder
        does not wait for it (the word of a hand-out that follows covers this one too)."""
        until = time.monotonic() + deadline
        quiet = [peer for peer, future in sends.items() if future is None]
        for peer in quiet:  # (awaited from the switch, as a sender's delivery says: its word is awaited too)
            self.comm.membership.entered(peer, step)
        notices = self._notices(quiet, step, deadline) if word else dict.fromkeys(quiet)
        while True:
            pending = [f for peer, f in sends.items()
                       if f is not None and not f.done() and peer not in self.comm.membership.dead()]
            if not pending or time.monotonic() >= until:
                break
            concurrent.futures.wait(pending, timeout=min(SETTLE_POLL, max(0.0, until - time.monotonic())))
        for peer, future in sends.items():
            if future is None:
                failure = notices.get(peer, "said nothing in time")
            else:
                failure = delivery_failure(future) if future.done() else "was not taken in time"
            if failure is not None:
                log.warning("node %d: step-%d state hand-out to node %d %s", self.rank, step, peer, failure)
            elif future is not None:  # it is at the switch with the members' state: the step's round waits for it
                self.comm.membership.entered(peer, step)

    def _notices(self, entering: list[int], step: int, deadline: float) -> dict[int, str | None]:
        """A quiet holder's wait for each entering node's word that it took the state from the
        others: None if it did, else why not."""
        if not entering:
            return {}
        got = self.comm.gather(KIND, step, entering, channel=self.notice_channel, deadline=deadline, laggards=True)
        said = {}
        for peer, message in got.items():
            said[peer] = None if float(message.tensor.view(-1)[0]) == 1.0 else "was sent, but not taken"
            message.release()
        return said

    def _notify(self, holders: tuple[int, ...], step: int, took: bool) -> None:
        """An entering node tells the holders that sent nothing that the transfer is over (so they go on)."""
        import torch

        senders = self.senders(holders)
        for holder in holders:
            if holder not in senders:
                self.comm.send(holder, torch.full((1,), 1.0 if took else 0.0, dtype=self.dtype), kind=KIND,
                               step=step, channel=self.notice_channel)

    def ready(self, step: int, holders: tuple[int, ...]) -> None:
        """An entering node, before it waits for another hand-out of the same switch: make this
        one's landing now too (take() then uses it), while the holders are still averaging and
        the machine is quiet, not while their bytes come."""
        if self._ready is not None:  # (one of an earlier switch that no take() used)
            self._forget(*self._ready[:2])
        self._ready = (step, holders, self._landing(step, holders))

    def take(self, like: torch.Tensor, step: int, holders: tuple[int, ...], deadline: float, *,
             notify: bool = True) -> tuple[torch.Tensor, bool, tuple[float, float]] | None:
        """An entering node's part: the holders' slices, joined in a new tensor shaped like `like`,
        whether every holder sent an average, and the transfer's (start, end) on time.monotonic():
        from the first slice's first bytes until the last one is in place (their checksums are
        checked as they come, 0.3 ms per 21 MB, and sums divided after). None when a slice is
        missing, fails its checksum or says another divisor than the others. `notify` False: the
        quiet holders hear nothing yet (a hand-out follows; its word covers this one too)."""
        import torch

        ready, self._ready = self._ready, None
        if ready is not None and ready[:2] == (step, holders) and like.device.type == "cpu":
            result = ready[2]
        elif like.device.type == "cpu":
            result = self._landing(step, holders)
        else:  # (bytes land in host memory first: the staging copies them over)
            result = torch.empty(self.numel, dtype=self.dtype, device=like.device)
        taken = None
        try:
            taken = self._join(result, like, step, holders, deadline)
            return taken
        finally:
            if notify:
                self._notify(holders, step, taken is not None)
            self._forget(step, holders)
            if ready is not None and ready[:2] != (step, holders):
                self._forget(*ready[:2])

    def _forget(self, step: int, holders: tuple[int, ...]) -> None:
        """Unregister the landing's destinations of that switch (those nothing landed in)."""
        senders = self.senders(holders)
        for index, sender in enumerate(senders):
            self.comm.receive_into(sender, KIND, step, None, channel=self._channel(len(senders), index))

    def _landing(self, step: int, holders: tuple[int, ...]) -> torch.Tensor:
        """The tensor the slices land in, each slice's destination registered with the transport,
        and its pages touched before the first byte comes: no copy and no page fault in the
        bytes' way (an entering node gets here steps before the holders, which train up to the
        switch, so this costs no transfer time)."""
        import torch

        result = torch.zeros(self.numel, dtype=self.dtype)  # (zeros: its pages are touched here)
        senders = self.senders(holders)
        for index, (sender, (a, b)) in enumerate(zip(senders, self._bounds(senders))):
            if b > a:
                self.comm.receive_into(sender, KIND, step, result[a:b], channel=self._channel(len(senders), index))
        return result

    def _join(self, result: torch.Tensor, like: torch.Tensor, step: int, holders: tuple[int, ...],
              deadline: float) -> tuple[torch.Tensor, bool, tuple[float, float]] | None:
        averaged, first, last, common = True, None, 0.0, None
        members = tuple(sorted(holders + (self.rank,)))
        senders = self.senders(holders)
        for index, (holder, (a, b)) in enumerate(zip(senders, self._bounds(senders))):
            if b == a:
                continue
            channel = self._channel(len(senders), index)
            try:
                message = self.hops.receive(holder, step, channel, "state slice", deadline,
                                            lambda holder=holder: self.hops.hopeless(members, holder, step, []))
            except CollectiveIncomplete as exc:
                log.warning("%s; keeping the donor's copy", exc)
                return None
            try:
                wanted_averaged, divisor, *wanted_sum = message.codec_params
                if checksum(message.tensor) != tuple(wanted_sum):
                    log.warning("node %d: step-%d state slice from node %d fails its checksum; keeping the donor's "
                                "copy", self.rank, step, holder)
                    return None
                common = divisor if common is None else common
                if divisor != common or not 1 <= divisor <= len(holders):
                    log.warning("node %d: step-%d state slice from node %d says to divide by %r (the first said %r, "
                                "of %d holders); keeping the donor's copy", self.rank, step, holder, divisor, common,
                                len(holders))
                    return None
                if message.tensor.data_ptr() != result[a:b].data_ptr():  # (it did not land in place)
                    result[a:b].copy_(message.tensor.view(-1))
                averaged = averaged and wanted_averaged == 1.0
                first = message.arrived_since if first is None else min(first, message.arrived_since)
                last = max(last, message.landed)
            finally:
                message.release()
        if first is None:  # (nothing to take: every slice empty)
            first = last = time.monotonic()
        if common is not None and common != 1.0:
            result.div_(common)  # (as each holder divides its own sums: the same bits)
        return result.view_as(like), averaged, (first, last)


__all__ = ["Outgoing", "StateHandout", "checksum", "slice_bounds"]
