"""Ring all-reduce (reduce-scatter + all-gather) over the node's Comm: an algorithm-side collective
(as in hivemind's averaging), so the transport never learns about codecs or segments.

The flat tensor is cut into n nearly equal segments. Reduce-scatter: in round r node i sends its
running sum of segment (i - r) mod n to i+1 and adds what i-1 sends it, so after n-1 rounds node i
owns the full sum of segment (i+1) mod n. All-gather: n-1 more rounds pass the finished segments
around the ring. Each node sends 2(n-1)/n of the tensor, the bandwidth-optimal amount (seed 004).

With a lossy codec every reduce-scatter hop decompresses, sums and recompresses (seed 004 §3.2);
an owner compresses its finished segment once and the all-gather forwards those bytes untouched,
and the owner adopts the decoded value itself, so all nodes end with bit-identical results.

Every round has its own channel, so the receiver knows the exact size of each segment (and accepts
only this ring's codec, in the layout compression.py gives it) and the mailbox never mixes rounds;
the step number keeps consecutive all-reduces apart.
"""
from __future__ import annotations

import concurrent.futures
import logging
from typing import TYPE_CHECKING

from p2ptrain import compression
from p2ptrain.algorithms.base import Comm, Kind

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

KIND = Kind.ALLREDUCE


def segment_bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    """[start, end) of each of `parts` nearly equal consecutive segments."""
    edges = [k * numel // parts for k in range(parts + 1)]
    return list(zip(edges[:-1], edges[1:]))


class CollectiveIncomplete(TimeoutError):
    """A collective could not complete (a peer missed the link deadline, refused, or is dead)."""


class RingAllReduce:
    """All-reduce of one fixed-size flat tensor on the ring i -> i+1; declare before comm.ready()."""

    def __init__(self, comm: Comm, numel: int, dtype: torch.dtype | None = None, *,
                 codec: compression.Codec | str | None = None, tag: str = "", kind: int = KIND):
        self.comm = comm
        self.rank, self.n = comm.rank, comm.world_size
        self.numel = numel
        self.codec = compression.get_codec(codec or "none") if not isinstance(codec, compression.Codec) else codec
        if dtype is None:
            import torch  # (here, not at import: the algorithm registry loads without torch)

            dtype = torch.float32
        self.dtype = dtype
        self._failed_at: int | None = None  # step of the last incomplete round
        self.tag, self.kind = tag, kind
        self.bounds = segment_bounds(numel, self.n)
        self.next, self.prev = (self.rank + 1) % self.n, (self.rank - 1) % self.n
        for r in range(self.n - 1):  # the segment node `rank` receives in each round
            for phase, segment in (("rs", self._rs_recv(r)), ("ag", self._ag_recv(r))):
                size = self._size(segment)
                comm.expect(kind, dtype, size, channel=self._channel(phase, r), codecs=self._layout(size))

    # Which segment moves where in round r -----------------------------------------------------------
    def _rs_send(self, r: int) -> int:
        return (self.rank - r) % self.n

    def _rs_recv(self, r: int) -> int:
        return (self.rank - r - 1) % self.n

    def _ag_send(self, r: int) -> int:
        return (self.rank + 1 - r) % self.n

    def _ag_recv(self, r: int) -> int:
        return (self.rank - r) % self.n

    def _size(self, segment: int) -> int:
        start, end = self.bounds[segment]
        return end - start

    def _layout(self, numel: int) -> dict[int, tuple[int, int]]:
        """What a segment of `numel` elements arrives as: this ring's codec, with its exact payload
        bytes and number of codec params."""
        codec = self.codec
        return {codec.wire_id: (codec.payload_bytes(numel, self.dtype), codec.param_count)}

    def _channel(self, phase: str, r: int) -> str:
        return f"{self.tag}{phase}{r}"

    def owned_segment(self) -> int:
        """The segment this node finishes in reduce-scatter: (rank + 1) mod n."""
        return (self.rank + 1) % self.n

    # The collective -------------------------------------------------------------------------------
    def __call__(self, tensor: torch.Tensor, step: int, *, average: bool = True) -> torch.Tensor:
        """Sum (or mean) of `tensor` over all nodes, written into `tensor` and returned.

        Raises CollectiveIncomplete, with `tensor` restored, when a ring neighbour's segment misses
        the link deadline or a node is dead (the ring is not re-formed: callers fall back to their
        local value for this step and the next call tries again)."""
        if tensor.numel() != self.numel or tensor.dtype != self.dtype:
            raise ValueError(f"all-reduce declared for {self.numel} x {self.dtype}, "
                             f"got {tensor.numel()} x {tensor.dtype}")
        if self.n == 1:
            return tensor
        if self._failed_at is not None:  # segments of a failed round may still come: throw them away
            self._discard_through(step - 1)
        if not self.comm.all_alive():
            self._failed_at = step
            raise CollectiveIncomplete(f"node {self.rank}: all-reduce of step {step} skipped: a node is dead")
        if not self.comm.make_room(self.next, 2 * (self.n - 1)):  # a stalled neighbour holds our last round
            self._failed_at = step
            raise CollectiveIncomplete(f"node {self.rank}: all-reduce of step {step} skipped: node {self.next} "
                                       "acknowledges nothing")
        original = tensor.clone()
        try:
            return self._ring(tensor, step, average)
        except CollectiveIncomplete:
            tensor.copy_(original)
            self._failed_at = step
            raise

    def reduce_or_keep(self, tensor: torch.Tensor, step: int, *, average: bool = True) -> torch.Tensor:
        """The all-reduce, or `tensor` unchanged when it cannot complete (a dropped link costs this
        step's averaging, never the run)."""
        try:
            return self(tensor, step, average=average)
        except CollectiveIncomplete as exc:
            log.warning("%s; keeping the local value for this step", exc)
            return tensor

    def _discard_through(self, step: int) -> None:
        for r in range(self.n - 1):
            for phase in ("rs", "ag"):
                for stale in self.comm.take(self.kind, step, channel=self._channel(phase, r)):
                    stale.release()
        self._failed_at = None

    def _ring(self, tensor: torch.Tensor, step: int, average: bool) -> torch.Tensor:
        flat = tensor.view(-1)
        segment = lambda k: flat[self.bounds[k][0]:self.bounds[k][1]]  # noqa: E731
        acks: list[concurrent.futures.Future] = []

        for r in range(self.n - 1):  # reduce-scatter: decompress, sum, recompress at every hop
            encoded = self.codec.encode(segment(self._rs_send(r)))
            acks.append(self._send(_own(encoded), encoded.codec, encoded.params, step, "rs", r))
            received = self._recv(step, "rs", r)
            segment(self._rs_recv(r)).add_(self._decode(received, self._size(self._rs_recv(r))))
            received.release()

        owned = segment(self.owned_segment())
        if average:
            owned.div_(self.n)
        encoded = self.codec.encode(owned)
        if encoded.codec != compression.UNCOMPRESSED:  # adopt the lossy value everybody else will get
            owned.copy_(self.codec.decode(encoded.payload, encoded.params, owned.shape, owned.dtype))
        payload, codec_id, params = _own(encoded), encoded.codec, encoded.params
        for r in range(self.n - 1):  # all-gather: finished segments travel on, bytes untouched
            acks.append(self._send(payload, codec_id, params, step, "ag", r))
            received = self._recv(step, "ag", r)
            target = segment(self._ag_recv(r))
            target.copy_(self._decode(received, target.numel()))
            if r < self.n - 2:
                payload, codec_id, params = received.tensor.clone(), received.codec, received.codec_params
            received.release()
        self._check(acks)
        return tensor

    def _send(self, payload: torch.Tensor, codec_id: int, params: tuple[float, ...], step: int,
              phase: str, r: int) -> concurrent.futures.Future:
        numel = self._size(self._rs_send(r) if phase == "rs" else self._ag_send(r))
        return self.comm.send(self.next, payload, kind=self.kind, step=step, channel=self._channel(phase, r),
                              codec=codec_id, codec_params=params, dtype=self.dtype, numel=numel,
                              shape=(numel,), reliable=True)

    def _recv(self, step: int, phase: str, r: int):
        got = self.comm.gather(self.kind, step, [self.prev], channel=self._channel(phase, r))
        if self.prev not in got:
            raise CollectiveIncomplete(f"node {self.rank}: step-{step} all-reduce segment ({phase} round {r}) "
                                       f"from node {self.prev} missed the link deadline")
        return got[self.prev]

    def _decode(self, received, numel: int) -> torch.Tensor:
        if received.codec == compression.UNCOMPRESSED:
            return received.tensor.view(-1)
        codec = compression.get_codec(received.codec)
        return codec.decode(received.tensor, received.codec_params, (numel,), self.dtype)

    def _check(self, acks: list[concurrent.futures.Future]) -> None:
        for future in acks:
            exc = future.exception()
            if exc is not None:
                raise CollectiveIncomplete(f"node {self.rank}: all-reduce message to node {self.next} "
                                           f"failed: {exc}")
            outcome = future.result()
            if not outcome.delivered:
                raise CollectiveIncomplete(f"node {self.rank}: all-reduce message refused by node {self.next}: "
                                           f"{outcome.reason}: {outcome.detail}")


def _own(encoded) -> torch.Tensor:
    """A payload the transport may keep: lossy encoders return fresh tensors, the identity codec a
    view of the caller's tensor, which later rounds modify."""
    return encoded.payload.clone() if encoded.codec == compression.UNCOMPRESSED else encoded.payload
