"""Receiving side of the transport: header validation, preallocated receive buffers, mailboxes.

Everything here except `BufferPool.release` runs on the node's event-loop thread. A tensor message
goes through `open()` (validate the header, reserve a buffer), `Reception.write()` per chunk
(straight into the buffer), then `deliver()`; any failure rejects the whole message and leaves
mailbox state untouched, so a broken or hostile stream can never half-apply.
"""
from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field

import torch

from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.transport.framing import torch_dtype
from p2ptrain.transport.validation import ChannelSpec, Rejection, validate_header


@dataclass
class Message:
    """A fully received tensor. `tensor` views a pooled buffer: call release() when consumed."""

    sender: int
    step: int
    kind: int
    channel: str
    tensor: torch.Tensor
    ps_weight: float
    relay_count: float
    codec: int
    codec_params: tuple[float, ...]
    shape: tuple[int, ...]
    message_id: int
    _release: object = field(default=None, repr=False)

    def release(self) -> None:
        """Give the receive buffer back to the pool (idempotent)."""
        release, self._release = self._release, None
        if release is not None:
            release()


class BufferPool:
    """Reusable byte buffers keyed by size, pinned when CUDA is in use (fast async H2D copies)."""

    def __init__(self, pin_memory: bool = False, max_free_per_size: int = 8):
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self.max_free_per_size = max_free_per_size
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._lock = threading.Lock()  # release() may come from the training thread

    def preallocate(self, nbytes: int, count: int) -> None:
        with self._lock:
            while len(self._free[nbytes]) < min(count, self.max_free_per_size):
                self._free[nbytes].append(self._allocate(nbytes))

    def acquire(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                return free.pop()
        return self._allocate(nbytes)

    def release(self, buffer: torch.Tensor) -> None:
        with self._lock:
            free = self._free[buffer.numel()]
            if len(free) < self.max_free_per_size:
                free.append(buffer)

    def _allocate(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin_memory)


class Reception:
    """One message being received: writes chunks at increasing offsets into its buffer."""

    def __init__(self, inbox: "Inbox", header: pb.TensorHeader, buffer: torch.Tensor):
        self.inbox = inbox
        self.header = header
        self.buffer = buffer
        self._view = memoryview(buffer.numpy()).cast("B") if buffer.numel() else memoryview(b"")
        self.received = 0

    def write(self, data: memoryview) -> None:
        end = self.received + len(data)
        if end > self.header.payload_bytes:
            raise Rejection("payload_overflow", f"stream carries more than the announced "
                                                f"{self.header.payload_bytes} bytes")
        self._view[self.received:end] = data
        self.received = end

    def complete(self) -> bool:
        return self.received == self.header.payload_bytes


class Inbox:
    """Validates incoming headers and keeps delivered messages until an algorithm takes them."""

    def __init__(self, rank: int, world_size: int, *, step_window: int = 64, pin_memory: bool = False,
                 dedup_window: int = 4096):
        self.rank = rank
        self.world_size = world_size
        self.step_window = step_window
        self.current_step = 0
        self.pool = BufferPool(pin_memory=pin_memory)
        self._specs: dict[tuple[int, str | None], ChannelSpec] = {}  # (kind, channel or None=any)
        # (kind, channel) -> step -> sender -> Message
        self._mail: dict[tuple[int, str], dict[int, dict[int, Message]]] = defaultdict(
            lambda: defaultdict(dict))
        self._seen: dict[int, OrderedDict[int, None]] = defaultdict(OrderedDict)
        self._in_progress: set[tuple[int, int]] = set()
        self._dedup_window = dedup_window
        self._waiters: list[tuple[object, asyncio.Future]] = []
        self.on_deliver = lambda sender: None           # e.g. membership: a message proves the sender alive
        self.excluded = lambda: frozenset()             # senders not worth waiting for (dead peers)

    # Configuration (thread-safe enough: plain attribute writes read on the loop thread) ---------
    def expect(self, kind: int, dtype: torch.dtype, numel: int, *, channel: str | None = None,
               preallocate: int = 2, max_payload_bytes: int | None = None) -> None:
        """Accept messages of `kind` holding `numel` elements of `dtype`; preallocates buffers.

        With `channel` the spec holds only for that channel (e.g. one ring all-reduce segment,
        whose size differs per round); otherwise for every channel without a spec of its own."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        spec = ChannelSpec(dtype, numel, max_payload_bytes or numel * itemsize)
        self._specs[(kind, channel)] = spec
        self.pool.preallocate(numel * itemsize, preallocate)

    def set_step(self, step: int) -> None:
        self.current_step = step

    # Receive path (loop thread) ---------------------------------------------------------------
    def open(self, header: pb.TensorHeader) -> Reception:
        """Validate a header and reserve a buffer; raises Rejection, or Duplicate via Rejection."""
        self._validate(header)
        key = (header.sender, header.message_id)
        if header.message_id in self._seen[header.sender] or key in self._in_progress:
            raise Rejection("duplicate", f"message {header.message_id} from {header.sender} already received")
        self._in_progress.add(key)
        return Reception(self, header, self.pool.acquire(header.payload_bytes))

    def abort(self, reception: Reception) -> None:
        """Drop a half-received message: buffer back to the pool, id free for a retry."""
        self._in_progress.discard((reception.header.sender, reception.header.message_id))
        self.pool.release(reception.buffer)

    def deliver(self, reception: Reception) -> Message:
        """Turn a complete reception into a mailbox message; rejects truncated streams and a
        second message for an occupied (kind, channel, step, sender) slot, which would otherwise
        overwrite and destroy the first one's push-sum mass."""
        header = reception.header
        if not reception.complete():
            self.abort(reception)
            raise Rejection("truncated", f"stream ended after {reception.received} of "
                                         f"{header.payload_bytes} payload bytes")
        box = self._mail[(header.kind, header.channel)][header.step]
        if header.sender in box:
            self.abort(reception)
            raise Rejection("duplicate_slot", f"already holding a step-{header.step} message of this "
                                              f"kind/channel from {header.sender}")
        self._in_progress.discard((header.sender, header.message_id))
        seen = self._seen[header.sender]
        seen[header.message_id] = None
        while len(seen) > self._dedup_window:
            seen.popitem(last=False)
        buffer = reception.buffer
        # Codec payloads stay raw bytes: the algorithm's codec decodes them.
        tensor = buffer.view(torch_dtype(header.dtype)) if header.codec == pb.CODEC_NONE else buffer
        message = Message(
            sender=header.sender, step=header.step, kind=header.kind, channel=header.channel,
            tensor=tensor, ps_weight=header.ps_weight, relay_count=header.relay_count,
            codec=header.codec, codec_params=tuple(header.codec_params),
            shape=tuple(header.shape) or (header.numel,), message_id=header.message_id,
            _release=lambda: self.pool.release(buffer))
        box[header.sender] = message
        self.on_deliver(header.sender)
        self._wake_waiters()
        return message

    def _validate(self, header: pb.TensorHeader) -> None:
        """The node's own checks (sender, receiver, route, kind, step window) around the shared
        header checks of validation.py."""
        if not 0 <= header.sender < self.world_size or header.sender == self.rank:
            raise Rejection("unknown_sender", f"sender {header.sender} is not a peer of node {self.rank} "
                                              f"(world size {self.world_size})")
        if header.receiver != self.rank:
            raise Rejection("wrong_receiver", f"message for node {header.receiver} reached node {self.rank}")
        if header.route:
            raise Rejection("bad_route", f"message for node {self.rank} still has relay hops {list(header.route)}")
        spec = self._specs.get((header.kind, header.channel)) or self._specs.get((header.kind, None))
        if spec is None:
            kind = pb.MessageKind.Name(header.kind) if header.kind in pb.MessageKind.values() else header.kind
            raise Rejection("unexpected_kind", f"node {self.rank} does not accept message kind {kind}")
        validate_header(header, spec, world_size=self.world_size)
        if header.kind != pb.MESSAGE_KIND_STATE and abs(header.step - self.current_step) > self.step_window:
            # (a state transfer carries the donor's step, which a rejoining node is far behind of)
            raise Rejection("stale_step" if header.step < self.current_step else "future_step",
                            f"step {header.step} outside [{self.current_step - self.step_window}, "
                            f"{self.current_step + self.step_window}]")

    # Consumer side (loop thread; the training thread reaches it through the Transport) ----------
    def _wake_waiters(self) -> None:
        for ready, future in list(self._waiters):
            if not future.done() and ready():
                future.set_result(None)

    def wake(self) -> None:
        """Re-check every waiter (e.g. a peer was declared dead: stop waiting for it)."""
        self._wake_waiters()

    async def wait_for(self, kind: int, step: int, senders: list[int], channel: str = "",
                       timeout: float | None = None, partial: bool = False) -> dict[int, Message]:
        """Wait until every sender's step-`step` message is here (senders in `excluded()`, i.e.
        dead peers, are not waited for); pop and return them. After `timeout` raise TimeoutError,
        or with `partial` return the messages that did arrive (the rest will be late)."""
        wanted = set(senders)

        def ready() -> bool:
            return (wanted - self.excluded()).issubset(self._mail[(kind, channel)].get(step, {}))

        if not ready():
            waiter = (ready, asyncio.get_running_loop().create_future())
            self._waiters.append(waiter)
            try:
                await asyncio.wait_for(waiter[1], timeout)
            except asyncio.TimeoutError:
                if not partial:
                    have = set(self._mail[(kind, channel)].get(step, {}))
                    raise TimeoutError(f"node {self.rank}: step-{step} messages from {sorted(wanted - have)} "
                                       f"did not arrive within {timeout:.1f}s") from None
            finally:
                self._waiters.remove(waiter)
        return self._pop(kind, channel, step, wanted)

    def take(self, kind: int, max_step: int, channel: str = "") -> list[Message]:
        """Pop every delivered message of `kind` with step <= max_step (late messages to fold in)."""
        boxes = self._mail[(kind, channel)]
        taken: list[Message] = []
        for step in sorted(s for s in boxes if s <= max_step):
            taken.extend(self._pop(kind, channel, step, set(boxes[step])).values())
        return taken

    def _pop(self, kind: int, channel: str, step: int, senders: set[int]) -> dict[int, Message]:
        boxes = self._mail[(kind, channel)]
        box = boxes.get(step, {})
        out = {s: box.pop(s) for s in sorted(senders) if s in box}
        if not box:
            boxes.pop(step, None)
        return out

    def pending(self) -> int:
        return sum(len(box) for boxes in self._mail.values() for box in boxes.values())


__all__ = ["Inbox", "Message", "Rejection", "Reception", "ChannelSpec", "BufferPool"]
