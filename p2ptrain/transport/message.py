"""Message: the one type of a received tensor, as the inbox delivers it and algorithms consume it.

Plain data with the header fields algorithms use; it owns a pooled receive buffer until release().
It never decodes a codec payload (algorithms do) and never touches the wire.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch


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
    # time.monotonic() when its header arrived, the first of its bytes (transfer rates: state_handout.py)
    arrived_since: float = 0.0
    landed: float = 0.0  # time.monotonic() when its last byte was in and it was delivered
    # max |v| of a raw float payload, measured as it arrived where its channel asked (Inbox.expect's
    # `peak`); None where it was not
    peak: float | None = None
    _release: object = field(default=None, repr=False)

    def release(self) -> None:
        """Give the receive buffer back to the pool (idempotent)."""
        release, self._release = self._release, None
        if release is not None:
            release()

    def on_device(self, tensor: torch.Tensor) -> "Message":
        """This message holding `tensor`, its device copy (CUDA staging), whose release() does
        nothing: the staging releases this host message once the copy has finished."""
        return dataclasses.replace(self, tensor=tensor, _release=None)


__all__ = ["Message"]
