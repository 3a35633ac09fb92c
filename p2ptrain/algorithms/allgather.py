"""Ring all-gather of every member's own encoded tensor: how DiLoCo exchanges pseudo-gradients
under sparse codecs (top-k, SparseLoCo, DCT top-k), whose outputs cannot be summed hop by hop.

Each member encodes its tensor once, with error feedback, and sends the payload to its successor;
in each of the m-1 rounds a node forwards, bytes untouched, the payload it just received, so every
member ends up with all m payloads, decodes them and sums them in rank order. Invariants: all
members end with bit-identical results; a node's residual holds only its own loss, input -
decode(encode(input)); a node sends m-1 payloads per call. Never: a payload is re-encoded, a call
completes on a ring its members disagree on, or the caller writes the input before the call
returns (uncompressed, the input itself is sent).
"""
from __future__ import annotations

import concurrent.futures
from typing import TYPE_CHECKING

from p2ptrain import compression
from p2ptrain.algorithms.base import Comm, Kind, buffer_like
from p2ptrain.algorithms.collectives import CollectiveIncomplete, RingHops, codec_and_dtype, ring_order

if TYPE_CHECKING:
    import torch

KIND = Kind.ALLREDUCE


class _Circle:
    """Who is where on one call's ring: `members` in rank order, this node at `position`."""

    def __init__(self, members: tuple[int, ...], rank: int):
        self.members, self.m = members, len(members)
        self.position = members.index(rank)
        self.next = members[(self.position + 1) % self.m]
        self.prev = members[(self.position - 1) % self.m]

    def origin(self, r: int) -> int:
        """Whose payload arrives in round r: the member r + 1 places before this node."""
        return self.members[(self.position - r - 1) % self.m]


class RingAllGather:
    """Sum (or mean) over a call's members of decode(encode(x_i)), every x_i encoded once, by the
    node that holds it, and exchanged by all-gather on the ring i -> i+1; declare before
    comm.ready().

    Why not RingAllReduce: its hops decompress, sum and recompress, so a top-k codec keeps the top
    k of partial sums, and each node's residual (error feedback) ends up holding the losses of sums
    that include other nodes' values. Here each node's residual is its own input - decode(encode(
    input)), exactly, and what comes out is every member's decoded payload, added in rank order on
    every node, so all members hold the same bits. Bytes: a node sends m-1 payloads (k entries each
    for top-k), where the ring sends 2(m-1)/m of the dense tensor, re-encoded at every hop.

    Channels are named by ring size and origin (the rank whose payload it is), declared for every
    size up front; each holds one payload of the codec's exact size, so a payload arrives with its
    origin whoever forwards it, and the receiver takes it only from its ring predecessor. As with
    RingAllReduce's elastic ring, members must agree on the member list: a node with another view
    waits on channels nobody sends on, and the call fails (CollectiveIncomplete) rather than
    complete over other members. A failed call throws away, at the next call, the payloads of
    earlier steps that arrive late."""

    def __init__(self, comm: Comm, numel: int, dtype: torch.dtype | None = None, *,
                 codec: compression.Codec | str | None = None, tag: str = "", kind: int = KIND, delay: int = 0):
        self.comm = comm
        self.rank, self.n = comm.rank, comm.world_size
        self.numel = numel
        self.codec, self.dtype = codec_and_dtype(codec, dtype)
        dtype = self.dtype
        self.tag, self.kind = tag, kind
        self.hops = RingHops(comm, kind, elastic=True, delay=delay, what="all-gather")
        self._failed_at: int | None = None  # step of the last incomplete call
        self._last_members: tuple[int, ...] = tuple(range(self.n))
        self._copies: dict[int, torch.Tensor] = {}  # origin -> its payload as received (reused)
        layout = {self.codec.wire_id: (self.codec.payload_bytes(numel, dtype), self.codec.param_count)}
        for m in range(2, self.n + 1):  # every ring size: re-forming the ring needs no new declaration
            for origin in range(self.n):
                comm.expect(kind, dtype, numel, channel=self._channel(m, origin), codecs=layout,
                            preallocate=2 if m == self.n else 0)

    def _channel(self, m: int, origin: int) -> str:
        return f"{self.tag}ag{m}.{origin}"

    @property
    def payload_bytes(self) -> int:
        """Bytes of one encoded payload: a node sends m-1 of them per call."""
        return self.codec.payload_bytes(self.numel, self.dtype)

    # The collective -------------------------------------------------------------------------------
    def __call__(self, tensor: torch.Tensor, step: int, *, average: bool = True, members=None,
                 residual: torch.Tensor | None = None, deadline: float | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """Σ_i decode(encode(x_i)) over the members in rank order (divided by m with `average`),
        written into `out` (default: a new tensor) and returned; `tensor` is only read.

        `members`: the ranks to gather from, this node among them (default: all). `residual`:
        tensor of the same size that receives tensor - decode(encode(tensor)) (error feedback).
        `deadline`: how long each payload is waited for (default: the link deadline). When the call
        returns, completed or not, the transport no longer reads `tensor`.

        Raises CollectiveIncomplete, with `residual` restored, when a payload misses the deadline,
        a member is dead, or a payload does not decode (the caller keeps its value for this step;
        the next call tries again)."""
        import torch

        if tensor.numel() != self.numel or tensor.dtype != self.dtype:
            raise ValueError(f"all-gather declared for {self.numel} x {self.dtype}, "
                             f"got {tensor.numel()} x {tensor.dtype}")
        if residual is not None and residual.numel() != self.numel:
            raise ValueError(f"the residual must have the declared {self.numel} elements")
        if out is None:
            out = torch.empty_like(tensor)
        elif out.numel() != self.numel or out.dtype != self.dtype or out is tensor:
            raise ValueError(f"all-gather output must be another {self.numel} x {self.dtype} tensor")
        circle = self._circle(members, step)
        if circle.m == 1:  # alone: nothing is exchanged, so nothing is encoded or lost
            if residual is not None:
                residual.zero_()
            return out.copy_(tensor)
        catching_up = self._failed_at is not None
        if catching_up or circle.members != self._last_members:
            self._discard_through(step - 1)  # payloads of a failed or re-formed ring may still come
        self._last_members = circle.members
        if not self.comm.make_room(circle.next, circle.m - 1):  # a stalled neighbour holds our last call
            self._failed_at = step
            raise CollectiveIncomplete(f"node {self.rank}: all-gather of step {step} skipped: node {circle.next} "
                                       "acknowledges nothing")
        kept = residual.clone() if residual is not None else None
        acks: list[concurrent.futures.Future] = []
        try:
            self._gather(tensor.reshape(-1), out.view(-1), step, average, circle, residual, acks, deadline,
                         catching_up)
            return out
        except CollectiveIncomplete:
            self.hops.fence(acks, circle.next)
            if residual is not None:
                residual.copy_(kept)
            self._failed_at = step
            raise

    def _circle(self, members, step: int) -> _Circle:
        members = tuple(range(self.n)) if members is None else ring_order(members, self.comm.membership.placed(step))
        if self.rank not in members or not all(0 <= m < self.n for m in members):
            raise ValueError(f"members {list(members)} must be ranks of this cluster, node {self.rank} among them")
        return _Circle(members, self.rank)

    def _discard_through(self, step: int) -> None:
        self.hops.discard_through(step, [self._channel(m, origin) for m in range(2, self.n + 1)
                                         for origin in range(self.n)])
        self._failed_at = None

    def _gather(self, flat: torch.Tensor, out: torch.Tensor, step: int, average: bool, circle: _Circle,
                residual: torch.Tensor | None, acks: list[concurrent.futures.Future], deadline: float | None,
                catching_up: bool) -> None:
        """Send this node's payload, take and forward the others' m-1, then (every send delivered)
        decode and add all m in rank order into `out`."""
        # after a failed call the first payload is awaited m link deadlines (members give up one
        # after another: see RingAllReduce._ring), later ones one
        link_deadline = self.comm.link_deadline
        first_deadline = max(deadline or link_deadline, circle.m * link_deadline) if catching_up else deadline
        failures: list[str] = []

        def hopeless() -> str | None:
            return self.hops.hopeless(circle.members, circle.prev, step, failures)

        coming = self.hops.approach(circle.members, circle.prev, step)
        if residual is None:
            encoded, own = self.codec.encode(flat), None
        else:
            encoded, own = compression.encode_with_feedback(self.codec, flat, residual.view(-1))
        payloads = {self.rank: (encoded.payload, encoded.codec, tuple(encoded.params))}
        self.hops.watch(self._send(circle, self.rank, *payloads[self.rank], step), acks, failures)
        for r in range(circle.m - 1):
            origin = circle.origin(r)
            received = self.hops.receive(circle.prev, step, self._channel(circle.m, origin),
                                         f"all-gather payload of node {origin} (round {r})",
                                         first_deadline if r == 0 else deadline, hopeless, coming)
            # a copy: the pooled buffer it came in goes back at once, the forward reads it until acknowledged
            payloads[origin] = (self._copy(origin, received.tensor), received.codec, tuple(received.codec_params))
            received.release()
            if r < circle.m - 2:
                self.hops.watch(self._send(circle, origin, *payloads[origin], step), acks, failures)
        self.hops.check(acks, circle.next)  # every send delivered before `out` is written (it may view the input)
        for i, rank in enumerate(circle.members):
            payload, codec_id, params = payloads[rank]
            try:
                decoded = own if rank == self.rank and own is not None else self._decode(payload, codec_id, params)
            except compression.CompressionError as exc:  # forged on the way: every node after it refuses alike
                raise CollectiveIncomplete(f"node {self.rank}: step-{step} all-gather payload of node {rank} "
                                           f"cannot be decoded: {exc}") from exc
            if i == 0:
                out.copy_(decoded)
            else:
                out.add_(decoded)
        if average:
            out.div_(circle.m)

    def _decode(self, payload: torch.Tensor, codec_id: int, params: tuple[float, ...]) -> torch.Tensor:
        if codec_id == compression.UNCOMPRESSED:
            return payload.view(-1)
        return compression.get_codec(codec_id).decode(payload, params, (self.numel,), self.dtype)

    def _copy(self, origin: int, payload: torch.Tensor) -> torch.Tensor:
        """`payload` copied into origin's buffer, reused from call to call (every send of a call has
        settled when it returns)."""
        buffer = self._copies.get(origin)
        flat = payload.view(-1)
        if buffer is None or buffer.numel() != flat.numel() or buffer.dtype != flat.dtype:
            buffer = self._copies[origin] = buffer_like(flat)
        return buffer.copy_(flat)

    def _send(self, circle: _Circle, origin: int, payload: torch.Tensor, codec_id: int, params: tuple[float, ...],
              step: int) -> concurrent.futures.Future:
        return self.comm.send(circle.next, payload, kind=self.kind, step=step, channel=self._channel(circle.m, origin),
                              codec=codec_id, codec_params=params, dtype=self.dtype, numel=self.numel,
                              shape=(self.numel,), reliable=True)


__all__ = ["RingAllGather"]
