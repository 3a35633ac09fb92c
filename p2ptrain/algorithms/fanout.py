"""Hand the members' state to nodes that took a donor's copy, straight from every holder at once.

At a view switch where every member that holds the members' state holds the same bits (no round
failed or was skipped on any of them since they last averaged), an average would change nothing
for them, and a ring would send each node 2(m-1)/m of the state. Instead holder i of k sends
slice i of its values to each taker: a taker receives the state once, from all holders in
parallel (the lane chunks each message), as torchft's healing streams a checkpoint from several
peers. Each slice carries the CRC32 of its bytes and of the holder's whole vector, so a taker
keeps only slices that check out, from holders that agree. When a holder dies mid-way the next
live holder sends its slice; holders wait for each taker's acknowledgement (or its death), and
until then neither touch the values they send from nor step on.
"""
from __future__ import annotations

import logging
import time
import zlib
from typing import TYPE_CHECKING

from p2ptrain import compression
from p2ptrain.algorithms.base import Comm, Kind
from p2ptrain.algorithms.collectives import segment_bounds

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

KIND = Kind.ALLREDUCE
POLL = 0.05  # seconds between looks at who died, while a holder waits for acknowledgements


class FanOutIncomplete(RuntimeError):
    """A taker could not assemble the state (no live holder left for a slice, a checksum failed,
    or the deadline passed): it keeps its own values."""


def crc32(values: torch.Tensor) -> float:
    """The CRC32 of a contiguous tensor's bytes, as a codec parameter (a double holds it exactly)."""
    import torch

    return float(zlib.crc32(values.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy()))


class FanOut:
    """Holders give, takers take `numel` values of `dtype` at a step (channels under `tag`)."""

    def __init__(self, comm: Comm, numel: int, dtype: torch.dtype, *, tag: str):
        import torch

        self.comm, self.rank = comm, comm.rank
        self.numel, self.dtype, self.tag = numel, dtype, tag
        self.ack_channel = f"{tag}fanack"
        for k in range(1, comm.world_size + 1):  # every holder count: any member may be a taker
            for i, (a, b) in enumerate(segment_bounds(numel, k)):
                comm.expect(KIND, dtype, b - a, channel=self._channel(k, i),
                            codecs={compression.UNCOMPRESSED: ((b - a) * dtype.itemsize, 2)})
        comm.expect(KIND, torch.float64, 1, channel=self.ack_channel,
                    codecs={compression.UNCOMPRESSED: (8, 0)})
        self.received: list[tuple[float, float]] = []  # (bytes, seconds) of each completed take

    def _channel(self, k: int, i: int) -> str:
        return f"{self.tag}fan{k}.{i}"

    # Holders ------------------------------------------------------------------------------------
    def give(self, values: torch.Tensor, step: int, holders: tuple[int, ...], takers: tuple[int, ...],
             deadline: float, whole: float | None = None) -> None:
        """Send this holder's slice (and the slices of holders that died, when it is their next
        live holder) to every taker, and wait until each acknowledged or died, `deadline` seconds
        at most. `values` is read in place, never written; `whole`: its CRC32, if known."""
        import concurrent.futures

        membership = self.comm.membership
        k = len(holders)
        bounds = segment_bounds(self.numel, k)
        whole = crc32(values) if whole is None else whole
        sends: list[concurrent.futures.Future] = []

        def send(i: int) -> None:
            a, b = bounds[i]
            part = values[a:b]
            params = (crc32(part), whole)
            sends.extend(self.comm.send(t, part, kind=KIND, step=step, channel=self._channel(k, i),
                                        codec=compression.UNCOMPRESSED, codec_params=params, dtype=self.dtype,
                                        numel=b - a, shape=(b - a,), reliable=True)
                         for t in takers if t not in membership.dead())

        sent = {holders.index(self.rank)}
        send(holders.index(self.rank))
        waiting = set(takers)
        began = time.monotonic()
        ends, probed = began + deadline, 0
        while waiting and time.monotonic() < ends:
            if time.monotonic() - began > (probed + 1) * self.comm.link_deadline:  # slow: is a holder gone?
                probed += 1
                for holder in membership.live(h for h in holders if h != self.rank):
                    membership.probe(holder)  # (a dead one is declared so, and its slice sent below)
            for i, holder in enumerate(holders):  # slices of dead holders this one stands in for
                if i not in sent and self._sender_of(i, holders) == self.rank:
                    sent.add(i)
                    log.info("node %d: step %d: sending the state slice of dead node %d", self.rank, step, holder)
                    send(i)
            got = self.comm.gather(KIND, step, sorted(waiting), channel=self.ack_channel, deadline=POLL,
                                   laggards=True)
            for message in got.values():
                message.release()
            waiting -= set(got) | membership.dead()
        if waiting:
            log.warning("node %d: step-%d state hand-out: no acknowledgement from taker(s) %s within %.0f s",
                        self.rank, step, sorted(waiting), deadline)
        concurrent.futures.wait(sends, timeout=max(0.0, ends - time.monotonic()))  # they read `values`

    def _sender_of(self, i: int, holders: tuple[int, ...]) -> int | None:
        """Who sends slice i: holder i if alive, else the next live holder after it (None: none)."""
        dead = self.comm.membership.dead()
        for j in range(len(holders)):
            holder = holders[(i + j) % len(holders)]
            if holder not in dead:
                return holder
        return None

    # Takers -------------------------------------------------------------------------------------
    def take(self, values: torch.Tensor, step: int, holders: tuple[int, ...], deadline: float) -> torch.Tensor:
        """`values`, overwritten in place with the holders' values once every slice came (each
        waited for up to `deadline` seconds from its current sender) and checked out; acknowledges
        to every live holder either way. Raises FanOutIncomplete, `values` untouched, when it
        cannot. (The slices stay in their receive buffers until all are checked: no second copy.)"""
        import torch

        k = len(holders)
        began = time.monotonic()
        messages = []
        try:
            for i in range(k):
                messages.append(self._slice(step, holders, i, deadline))
            if len({message.codec_params[1] for message in messages}) != 1:
                raise FanOutIncomplete(f"node {self.rank}: step-{step} state holders {list(holders)} disagree "
                                       "(different checksums of the whole state)")
            for i, message in enumerate(messages):
                if crc32(message.tensor) != message.codec_params[0]:
                    raise FanOutIncomplete(f"node {self.rank}: step-{step} state slice {i} from node "
                                           f"{message.sender} failed its checksum")
            for (a, b), message in zip(segment_bounds(self.numel, k), messages):
                values[a:b].copy_(message.tensor.view(-1))
        finally:
            for message in messages:
                message.release()
            ack = torch.ones(1, dtype=torch.float64)
            for holder in self.comm.membership.live(holders):
                self.comm.send(holder, ack, kind=KIND, step=step, channel=self.ack_channel,
                               codec=compression.UNCOMPRESSED, dtype=torch.float64, numel=1, shape=(1,))
            self._discard(step, k)
        self.received.append((float(values.numel() * values.element_size()), time.monotonic() - began))
        return values

    def _slice(self, step: int, holders: tuple[int, ...], i: int, deadline: float):
        """Slice i's message from its current sender, following it to the next live holder when
        the sender dies."""
        channel = self._channel(len(holders), i)
        ends = time.monotonic() + deadline
        while True:
            sender = self._sender_of(i, holders)
            if sender is None:
                raise FanOutIncomplete(f"node {self.rank}: step-{step} state slice {i}: every holder "
                                       f"{list(holders)} is dead")
            dead = self.comm.membership.dead

            def gone(sender=sender) -> str | None:
                return f"node {sender} died" if sender in dead() else None

            got = self.comm.gather(KIND, step, [sender], channel=channel, abandon=gone, laggards=True,
                                   deadline=max(0.0, ends - time.monotonic()))
            if sender in got:
                return got[sender]
            if gone() is None and time.monotonic() >= ends:
                raise FanOutIncomplete(f"node {self.rank}: step-{step} state slice {i} from node {sender} "
                                       f"missed the deadline ({deadline:.0f} s)")

    def _discard(self, step: int, k: int) -> None:
        """Slices that came besides the ones used (a holder that died after sending, its stand-in)."""
        for i in range(k):
            for stale in self.comm.take(KIND, step, channel=self._channel(k, i)):
                stale.release()


__all__ = ["FanOut", "FanOutIncomplete", "crc32"]
