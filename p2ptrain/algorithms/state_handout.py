"""The members' state handed straight to the nodes that enter a ring at a view switch.

A node new in a view (View.entering: a restarted or joining node) holds a donor's copy of an earlier
step. At the switch the other members, the holders, average among themselves; then each sends its
slice of the result to every entering node, all in parallel, point to point (over the TCP lane where
there is one). So an entering node starts the switch step with the members' state bit for bit, and
the bytes it takes cross the wire once instead of passing a ring they would slow. Each slice says
whether the holders' average completed and carries a checksum of its bits; a slice that is missing
or wrong leaves the entering node with its donor's copy, marked apart, so that the next switch or
the end of the run averages it in (with weight 0: MemberRing).
"""
from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import TYPE_CHECKING

from p2ptrain import compression
from p2ptrain.algorithms.collectives import KIND, CollectiveIncomplete, RingHops, delivery_failure, segment_bounds

if TYPE_CHECKING:
    import torch

    from p2ptrain.algorithms.base import Comm

log = logging.getLogger(__name__)

CHECKSUM_MODULUS = 1 << 52  # checksums travel as codec params (doubles): exact below 2^53
SETTLE_POLL = 0.1  # seconds between looks for dead entering nodes while a holder waits for its sends


def checksum(values: torch.Tensor) -> float:
    """The wrapping sum of `values`' 64-bit words (counted from its first byte), plus its last
    bytes weighted by position, modulo 2^52: one cheap pass that any single flipped bit changes."""
    import torch

    raw = values.reshape(-1).view(torch.uint8)
    whole = raw.numel() // 8 * 8
    words = raw[:whole] if raw.storage_offset() % 8 == 0 else raw[:whole].clone()  # (a view needs alignment)
    total = int(words.view(torch.int64).sum()) if whole else 0
    total += sum(byte * (i + 1) for i, byte in enumerate(raw[whole:].tolist()))
    return float(total % CHECKSUM_MODULUS)


class StateHandout:
    """Hand a flat state of `numel` x `dtype` from the holders to the entering nodes of a switch;
    declare before comm.ready(). A channel per number of holders and slice, so that every slice
    arrives with its exact size; `tag` keeps the model's and the optimizer state's apart."""

    def __init__(self, comm: Comm, numel: int, dtype: torch.dtype, *, tag: str):
        self.comm, self.rank = comm, comm.rank
        self.numel, self.dtype, self.tag = numel, dtype, tag
        self.hops = RingHops(comm, KIND, elastic=True, what="state hand-out")
        for holders in range(1, comm.world_size):
            for index, (a, b) in enumerate(segment_bounds(numel, holders)):
                if b > a:  # raw values; (averaged, checksum) in the codec params
                    comm.expect(KIND, dtype, b - a, channel=self._channel(holders, index),
                                codecs={compression.UNCOMPRESSED: ((b - a) * dtype.itemsize, 2)}, preallocate=0)

    def _channel(self, holders: int, index: int) -> str:
        return f"{self.tag}{holders}.{index}"

    def give(self, values: torch.Tensor, step: int, holders: tuple[int, ...], entering: tuple[int, ...],
             averaged: bool, deadline: float) -> None:
        """A holder's part: its slice of `values` (which nobody writes to afterwards: the sends read
        it) to every entering node, and wait until they took it (at most `deadline` seconds, and
        not for a node found dead): the transfer then has the machine to itself, and the ring's
        next round starts with every member there."""
        flat = values.reshape(-1)
        index = holders.index(self.rank)
        a, b = segment_bounds(self.numel, len(holders))[index]
        if b == a:
            return
        piece = flat[a:b]
        params = (1.0 if averaged else 0.0, checksum(piece))
        sends = {peer: self.comm.send(peer, piece, kind=KIND, step=step, channel=self._channel(len(holders), index),
                                      codec=compression.UNCOMPRESSED, codec_params=params, dtype=self.dtype,
                                      numel=b - a, shape=(b - a,), reliable=True)
                 for peer in entering}
        until = time.monotonic() + deadline
        while True:
            pending = [f for peer, f in sends.items() if not f.done() and peer not in self.comm.membership.dead()]
            if not pending or time.monotonic() >= until:
                break
            concurrent.futures.wait(pending, timeout=min(SETTLE_POLL, max(0.0, until - time.monotonic())))
        for peer, future in sends.items():
            failure = delivery_failure(future) if future.done() else "was not taken in time"
            if failure is not None:
                log.warning("node %d: step-%d state hand-out to node %d %s", self.rank, step, peer, failure)
            else:  # it is at the switch with the members' state: the step's round waits for it
                self.comm.membership.entered(peer, step)

    def take(self, like: torch.Tensor, step: int, holders: tuple[int, ...],
             deadline: float) -> tuple[torch.Tensor, bool, float] | None:
        """An entering node's part: the holders' slices, joined (a new tensor shaped like `like`),
        whether every holder sent an average, and the seconds from the first slice's first bytes to
        the last one's arrival; None when a slice is missing or fails its checksum."""
        import torch

        result = torch.empty(self.numel, dtype=self.dtype, device=like.device)
        averaged, first = True, None
        members = tuple(sorted(holders + (self.rank,)))
        for index, (holder, (a, b)) in enumerate(zip(holders, segment_bounds(self.numel, len(holders)))):
            if b == a:
                continue
            channel = self._channel(len(holders), index)
            try:
                message = self.hops.receive(holder, step, channel, "state slice", deadline,
                                            lambda holder=holder: self.hops.hopeless(members, holder, step, []))
            except CollectiveIncomplete as exc:
                log.warning("%s; keeping the donor's copy", exc)
                return None
            try:
                wanted_averaged, wanted_sum = message.codec_params
                if checksum(message.tensor) != wanted_sum:
                    log.warning("node %d: step-%d state slice from node %d fails its checksum; keeping the donor's "
                                "copy", self.rank, step, holder)
                    return None
                result[a:b].copy_(message.tensor.view(-1))
                averaged = averaged and wanted_averaged == 1.0
                first = message.arrived_since if first is None else min(first, message.arrived_since)
            finally:
                message.release()
        seconds = time.monotonic() - first if first is not None else 0.0
        return result.view_as(like), averaged, seconds


__all__ = ["CHECKSUM_MODULUS", "StateHandout", "checksum"]
