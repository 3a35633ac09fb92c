"""The node as its algorithm sees it: the implementation of p2ptrain.algorithms.base.Comm on top of
the node's Transport.

Algorithms never open sockets: they call these methods with tensors on their own device, and the
communicator stages them through host memory, speaks the transport's wire enums for them and turns
Acks into Deliveries. Who the members are is the transport's Membership itself (`membership`), not
a copy. It sits between the two layers, so neither imports the other.
"""
from __future__ import annotations

import concurrent.futures
import logging

import torch

from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.addresses import split_address
from p2ptrain.algorithms.base import Delivery
from p2ptrain.comm_worker import CommWorker
from p2ptrain.transport import host_memory
from p2ptrain.transport.message import Message
from p2ptrain.transport.staging import Staging
from p2ptrain.transport.transport import Transport
from p2ptrain.transport.validation import CodecLayout

log = logging.getLogger(__name__)


class Communicator:
    def __init__(self, transport: Transport, device: torch.device | str = "cpu", peer_timeout: float = 120.0):
        self.transport = transport
        self.membership = transport.membership
        self.rank = transport.rank
        self.world_size = transport.world_size
        self.staging = Staging(device)
        self.peer_timeout = peer_timeout
        self.joined: Message | None = None  # the state a (re)joining node took from a donor (train/elastic.py)
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

    def unexpect(self, kind: int, channel: str | None = None) -> None:
        """Refuse `kind` messages from now on (the senders learn at once: "unexpected_kind")."""
        self.transport.unexpect(kind, channel)

    def ready(self, neighbours=None) -> None:
        """Call after every expect(): this node accepts every message now. A (re)joining node tells
        the live peers it is back and at which step, and stands for membership; a starting one waits
        until all peers are ready too (the lowest public node first lays the members out, while the
        others wait for it: placement.py). With TransportOptions.meet = "neighbours" it waits only
        for `neighbours`, the peers its algorithm sends to or hears from (None: all), and nobody
        lays the members out (that needs every member's answer)."""
        membership = self.membership
        near = neighbours if self.transport.options.meet == "neighbours" else None
        if not membership.joining and self.world_size > 1 and self.transport.options.meet == "everyone":
            membership.lay_out(timeout=self.peer_timeout)
        self.transport.mark_ready()
        if membership.joining:
            membership.announce_ready()
            membership.wants_in = True  # now that it accepts every message it asks to be a member, if new
            membership.reconcile()
        elif self.world_size > 1:
            membership.wait_for_peers(timeout=self.peer_timeout, require_ready=True, peers=near)

    def set_step(self, step: int) -> None:
        self.membership.set_step(step)

    def host(self, peer: int) -> str:
        """The host `peer`'s address names ("" when unknown): nodes that name one host share its
        CPUs and network (a state hand-out sends one stream per host)."""
        address = split_address(self.transport.peers[peer]) if 0 <= peer < self.world_size else None
        if address is None:
            return ""
        host = address[0].lower()
        return "127.0.0.1" if host == "localhost" else host

    def host_region(self, nbytes: int) -> host_memory.OwnRegion | None:
        """A region of `nbytes` of shared memory that this host's peers can map (host_memory.py), or
        None where there are none: another platform, shared memory turned off, TLS (as the lane's),
        or emulated links (--link, --link-burst: the network they describe stands between the nodes)."""
        options = self.transport.options
        if not (options.shared_memory and not options.security.tls and host_memory.supported()):
            return None
        if self.transport.links is not None:  # (set where the table emulates anything)
            return None
        try:
            return host_memory.OwnRegion(nbytes)
        except OSError as exc:
            log.warning("node %d: no shared memory for a host collective (%s): messages instead", self.rank, exc)
            return None

    def map_host_region(self, offer: tuple[int, int, int], nbytes: int) -> host_memory.PeerRegion:
        """A peer's region of this host from its offer (pid, fd, nonce); ValueError where it cannot be mapped."""
        return host_memory.PeerRegion.open(*offer, nbytes)

    def make_room(self, peer: int, window: int) -> bool:
        """Before sending to `peer`: True once fewer than `window` of our messages to it await their
        Ack. A peer that stays silent a whole link deadline gets a probe (and is declared dead if
        it does not answer); then this returns False and the caller skips it this step. This is
        what keeps a stalled peer from soaking up push-sum mass (or memory) it cannot give back."""
        waiting = self.transport.sender.outstanding(peer)
        if len(waiting) < window:
            return True
        oldest = waiting[:len(waiting) - window + 1]
        concurrent.futures.wait(oldest, timeout=self.link_deadline)
        if all(f.done() for f in oldest):
            return True
        log.warning("node %d: node %d acknowledged none of our last %d messages within the link deadline; "
                    "skipping it this step", self.rank, peer, len(waiting))
        self.membership.probe(peer)
        return False

    def send(self, peer: int, tensor: torch.Tensor, **header) -> concurrent.futures.Future:
        """Push `tensor` to `peer`; the caller must not modify it afterwards. A future of its
        Delivery (the algorithms' view of the peer's Ack)."""
        return _delivery(self.transport.sender.send(peer, self.staging.to_host(tensor), **header))

    def background(self, fn, *args, **kwargs) -> concurrent.futures.Future:
        """Run fn(*args, **kwargs) on this node's communication worker, after every job submitted
        before it (comm_worker.py): how algorithms overlap communication with compute."""
        return self._worker.submit(fn, *args, **kwargs)

    def close(self) -> None:
        """Stop the communication worker (after the transport: a job still waiting then fails)."""
        self._worker.close()

    def gather(self, kind: int, step: int, senders: list[int], *, channel: str = "",
               deadline: float | None = None, abandon=None, laggards: bool = False) -> dict[int, Message]:
        """The step-`step` messages of the live senders that arrive within the link deadline (or
        until `abandon()` says why waiting is hopeless); a missing one counts as a dropped link for
        this step (see Transport.gather)."""
        messages = self.transport.gather(kind, step, senders, channel=channel, deadline=deadline, abandon=abandon,
                                         laggards=laggards)
        return {sender: self.received(m) for sender, m in messages.items()}

    def receive_into(self, peer: int, kind: int, step: int, tensor: torch.Tensor | None, *, channel: str = "") -> bool:
        """Have `peer`'s step-`step` message of `kind` on `channel` land in `tensor` (a contiguous
        CPU tensor of its size) rather than in a pooled buffer; None forgets it. False where this
        does not apply (a tensor on CUDA: the bytes land in host memory first anyway)."""
        if tensor is not None and (tensor.device.type != "cpu" or not tensor.is_contiguous()):
            return False
        self.transport.receive_into(peer, kind, step, None if tensor is None else tensor.view(-1).view(torch.uint8),
                                    channel)
        return True

    def take(self, kind: int, max_step: int, *, channel: str = "") -> list[Message]:
        """Already-arrived messages with step <= max_step (late ones, to be folded in)."""
        return [self.received(m) for m in self.transport.take(kind, max_step, channel)]

    def received(self, message: Message) -> Message:
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
