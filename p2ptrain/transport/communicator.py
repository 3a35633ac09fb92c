"""The algorithm-facing facade of the transport: send / recv / take on the training device.

Algorithms never open sockets: they call these methods with tensors on their own device, and the
facade stages them through host memory and the node's Transport.
"""
from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from typing import Callable

import torch

from p2ptrain.transport.runtime import Transport
from p2ptrain.transport.staging import Staging


@dataclass
class Received:
    """A received tensor on the training device, with the header fields algorithms use.

    On CPU `tensor` views a pooled receive buffer (no copy): call release() once consumed.
    """

    sender: int
    step: int
    tensor: torch.Tensor
    ps_weight: float
    relay_count: float
    codec: int
    codec_params: tuple[float, ...]
    shape: tuple[int, ...]
    release: Callable[[], None] = lambda: None


class Communicator:
    def __init__(self, transport: Transport, device: torch.device | str = "cpu", peer_timeout: float = 120.0):
        self.transport = transport
        self.rank = transport.rank
        self.world_size = transport.world_size
        self.staging = Staging(device)
        self.peer_timeout = peer_timeout

    def expect(self, kind: int, dtype: torch.dtype, numel: int, **kwargs) -> None:
        self.transport.expect(kind, dtype, numel, **kwargs)

    def ready(self) -> None:
        """Call after every expect(): announce readiness and wait until all peers are ready too."""
        self.transport.mark_ready()
        if self.world_size > 1:
            self.transport.wait_for_peers(timeout=self.peer_timeout, require_ready=True)

    def set_step(self, step: int) -> None:
        self.transport.set_step(step)

    def send(self, peer: int, tensor: torch.Tensor, **header) -> concurrent.futures.Future:
        """Push `tensor` to `peer`; the caller must not modify it afterwards. Future of the Ack."""
        return self.transport.send(peer, self.staging.to_host(tensor), **header)

    def recv(self, kind: int, step: int, senders: list[int], *, channel: str = "",
             timeout: float | None = None) -> dict[int, Received]:
        """Wait for each sender's step-`step` message (TimeoutError after the peer timeout)."""
        messages = self.transport.recv(kind, step, senders, channel=channel,
                                       timeout=self.peer_timeout if timeout is None else timeout)
        return {sender: self._received(m) for sender, m in messages.items()}

    def take(self, kind: int, max_step: int, *, channel: str = "") -> list[Received]:
        """Already-arrived messages with step <= max_step (late ones, to be folded in)."""
        return [self._received(m) for m in self.transport.take(kind, max_step, channel)]

    def ring_allreduce(self, numel: int, dtype: torch.dtype = torch.float32, *, codec=None, tag: str = ""):
        """A RingAllReduce for flat tensors of `numel` x `dtype` (declares its channels: call
        before ready()); calling it with (tensor, step) all-reduces the tensor in place."""
        from p2ptrain.transport.collectives import RingAllReduce

        return RingAllReduce(self, numel, dtype, codec=codec, tag=tag)

    def _received(self, message) -> Received:
        tensor = self.staging.to_device(message)  # CUDA: the staging releases the pinned buffer
        release = message.release if not self.staging.cuda else (lambda: None)
        return Received(message.sender, message.step, tensor, message.ps_weight, message.relay_count,
                        message.codec, message.codec_params, message.shape, release)
