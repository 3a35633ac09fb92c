"""Host <-> device staging of tensors that cross the wire.

On CUDA, receive buffers are pinned and copied to the GPU with non_blocking copies on a side
stream, so the H2D copy overlaps compute; the compute stream waits on an event rather than the
host blocking. On CPU every method is the identity.
"""
from __future__ import annotations

import torch


class Staging:
    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(device=self.device) if self.cuda else None
        self._in_flight: list[tuple[object, object]] = []  # (event, message) awaiting copy completion

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """A CPU copy safe to hand to the transport (it must not change while being sent)."""
        if not self.cuda:
            return tensor
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            host.copy_(tensor, non_blocking=True)
        self._stream.synchronize()  # the transport thread reads `host` right away
        return host

    def to_device(self, message) -> torch.Tensor:
        """Device tensor with the message's contents; releases its pinned buffer once copied."""
        if not self.cuda:
            return message.tensor
        with torch.cuda.stream(self._stream):
            device_tensor = message.tensor.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        torch.cuda.current_stream(self.device).wait_event(event)
        device_tensor.record_stream(torch.cuda.current_stream(self.device))
        self._in_flight.append((event, message))
        self._release_finished()
        return device_tensor

    @property
    def pending(self) -> int:
        """Host buffers still held because their copy to the device may not have finished."""
        return len(self._in_flight)

    def _release_finished(self) -> None:
        still = []
        for event, message in self._in_flight:
            if event.query():
                message.release()
            else:
                still.append((event, message))
        self._in_flight = still

    def synchronize(self) -> None:
        for event, message in self._in_flight:
            event.synchronize()
            message.release()
        self._in_flight = []
