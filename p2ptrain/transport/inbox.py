"""Receiving side of the transport: header validation, preallocated receive buffers, mailboxes.

Everything here except `BufferPool.release` runs on the node's event-loop thread. A tensor message
goes through `open()` (validate the header, reserve a buffer), `Reception.write()` per chunk
(straight into the buffer), then `deliver()`; any failure rejects the whole message and leaves
mailbox state untouched, so a broken or hostile stream can never half-apply.
"""
from __future__ import annotations

import asyncio
import math
import threading
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field

import torch

from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.transport.framing import WIRE_TO_TORCH, torch_dtype


# Codec params per wire codec (compression.py: int8 sends its scale, the others none).
_CODEC_PARAMS = {pb.CODEC_NONE: 0, pb.CODEC_FP16_TRUNCATE: 0, pb.CODEC_INT8_QUANTIZE: 1}


class Rejection(Exception):
    """A message refused with a reason code (goes into the Ack and the rejected-messages metric)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class ChannelSpec:
    """What a node accepts for one message kind: decoded dtype and element count."""

    dtype: torch.dtype
    numel: int
    max_payload_bytes: int | None = None  # codecs may send fewer bytes; never more than this


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
        self._voided: dict[int, OrderedDict[int, None]] = defaultdict(OrderedDict)  # settled, never delivered
        self._in_progress: set[tuple[int, int]] = set()
        self._dedup_window = dedup_window
        self._waiters: list[tuple[object, asyncio.Future]] = []
        self.on_deliver = lambda sender, step: None     # e.g. membership: the sender is alive, at `step`
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

    def unexpect(self, kind: int, channel: str | None = None) -> None:
        """Stop accepting messages of `kind` (e.g. state transfers once a rejoin is done)."""
        self._specs.pop((kind, channel), None)

    def set_step(self, step: int) -> None:
        self.current_step = step

    def settle(self, sender: int, message_ids: list[int]) -> list[int]:
        """Of `sender`'s `message_ids` (sent while a link failed), the ones delivered; the others are
        voided for good, so a copy still on its way is refused and the sender may take them back."""
        seen, voided = self._seen[sender], self._voided[sender]
        delivered = [m for m in message_ids if m in seen]
        for message_id in message_ids:
            if message_id not in seen:
                voided[message_id] = None
        while len(voided) > self._dedup_window:
            voided.popitem(last=False)
        return delivered

    # Receive path (loop thread) ---------------------------------------------------------------
    def open(self, header: pb.TensorHeader) -> Reception:
        """Validate a header and reserve a buffer; raises Rejection, or Duplicate via Rejection."""
        self._validate(header)
        key = (header.sender, header.message_id)
        if header.message_id in self._voided[header.sender]:
            raise Rejection("voided", f"message {header.message_id} from {header.sender} was settled as never "
                                      "delivered")
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
        if header.message_id in self._voided[header.sender]:  # settled while it was being received
            self.abort(reception)
            raise Rejection("voided", f"message {header.message_id} from {header.sender} was settled as never "
                                      "delivered")
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
        self.on_deliver(header.sender, header.step)
        self._wake_waiters()
        return message

    def _validate(self, header: pb.TensorHeader) -> None:
        if not 0 <= header.sender < self.world_size or header.sender == self.rank:
            raise Rejection("unknown_sender", f"sender {header.sender} is not a peer of node {self.rank} "
                                              f"(world size {self.world_size})")
        if header.receiver != self.rank:
            raise Rejection("wrong_receiver", f"message for node {header.receiver} reached node {self.rank}")
        if header.route:
            raise Rejection("bad_route", f"message for node {self.rank} still has relay hops {list(header.route)}")
        spec = self._specs.get((header.kind, header.channel)) or self._specs.get((header.kind, None))
        if spec is None:
            raise Rejection("unexpected_kind", f"node {self.rank} does not accept message kind "
                                               f"{pb.MessageKind.Name(header.kind) if header.kind in pb.MessageKind.values() else header.kind}")
        if header.dtype not in WIRE_TO_TORCH or WIRE_TO_TORCH[header.dtype] != spec.dtype:
            raise Rejection("bad_dtype", f"expected {spec.dtype}, got wire dtype {header.dtype}")
        if header.numel != spec.numel:
            raise Rejection("bad_size", f"expected {spec.numel} elements, got {header.numel}")
        if header.shape and (min(header.shape) < 0 or math.prod(header.shape) != header.numel):  # [-4, -4]
            raise Rejection("bad_shape", f"shape {list(header.shape)} does not hold {header.numel} elements")
        if header.codec not in pb.Codec.values():
            raise Rejection("bad_codec", f"unknown codec {header.codec}")
        self._validate_codec(header, spec)
        itemsize = torch.empty((), dtype=spec.dtype).element_size()
        if header.codec == pb.CODEC_NONE and header.payload_bytes != header.numel * itemsize:
            raise Rejection("bad_size", f"{header.payload_bytes} payload bytes for {header.numel} "
                                        f"x {spec.dtype}")
        if header.payload_bytes > (spec.max_payload_bytes or 0):
            raise Rejection("bad_size", f"{header.payload_bytes} payload bytes exceed the "
                                        f"{spec.max_payload_bytes} allowed")
        if not (math.isfinite(header.ps_weight) and math.isfinite(header.relay_count)):
            raise Rejection("bad_weight", "non-finite push-sum weight or relay counter")
        if header.kind != pb.MESSAGE_KIND_STATE and abs(header.step - self.current_step) > self.step_window:
            # (a state transfer carries the donor's step, which a rejoining node is far behind of)
            raise Rejection("stale_step" if header.step < self.current_step else "future_step",
                            f"step {header.step} outside [{self.current_step - self.step_window}, "
                            f"{self.current_step + self.step_window}]")

    @staticmethod
    def _validate_codec(header: pb.TensorHeader, spec: ChannelSpec) -> None:
        """A codec payload must decode (compression.py) without raising on the training thread:
        exact encoded size, the codec's number of params, params finite scales >= 0."""
        from p2ptrain.compression import get_codec

        params = header.codec_params
        if len(params) != _CODEC_PARAMS[header.codec] or not all(math.isfinite(p) and p >= 0 for p in params):
            raise Rejection("bad_codec_params", f"codec {header.codec} takes {_CODEC_PARAMS[header.codec]} finite "
                                                f"param(s) >= 0, got {list(params)}")
        if header.codec == pb.CODEC_NONE:
            return
        if not spec.dtype.is_floating_point:
            raise Rejection("bad_codec", f"codec {header.codec} cannot decode to {spec.dtype}")
        expected = get_codec(header.codec).payload_bytes(header.numel)
        if header.payload_bytes != expected:
            raise Rejection("bad_size", f"{header.payload_bytes} payload bytes for {header.numel} elements "
                                        f"in codec {header.codec}, which takes {expected}")

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
