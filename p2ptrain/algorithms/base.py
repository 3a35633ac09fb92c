"""What an algorithm is to the engine (Bagua-style hooks; the engine owns the loop).

The training engine keeps the model's parameters in one flat buffer. It calls `setup` once and
`after_step` after every local optimizer step, and loads whatever flat vector the algorithm returns
into the model before the next forward pass. Algorithms hold the seed's math and talk to peers
only through the Communicator.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class Algorithm(ABC):
    name = "algorithm"
    uses_gradients = False  # True: the engine calls reduce_gradients after every backward

    @abstractmethod
    def setup(self, params: torch.Tensor) -> torch.Tensor:
        """Called once with the initial flat parameters; returns the parameters to compute with."""

    @abstractmethod
    def after_step(self, step: int, params: torch.Tensor) -> torch.Tensor:
        """`params` = model after the local optimizer step of `step`; returns the model for step+1."""

    def reduce_gradients(self, step: int, grads: torch.Tensor) -> torch.Tensor | None:
        """Flat local gradient of `step` (a copy the algorithm may keep); returns the gradient to
        apply, or None to skip this step's optimizer update."""
        return grads

    def donate_state(self, peer: int, step: int, params: torch.Tensor) -> torch.Tensor | None:
        """Send this node's state to a (re)joining `peer` (called by the engine at a step boundary,
        with the current parameters); returns new parameters if donating changed them. Default:
        a copy of the model; push-sum algorithms split their mass instead (see SGP)."""
        from p2ptrain._proto import p2ptrain_pb2 as pb

        self.comm.send(peer, params.detach().clone(), kind=pb.MESSAGE_KIND_STATE, step=step, ps_weight=1.0,
                       reliable=True)
        return None

    def adopt_state(self, state, params: torch.Tensor) -> torch.Tensor:
        """A node that stalled and fell behind caught up: `state` is a donor's state transfer
        (p2ptrain.transport.message.Message), `params` the stale local model; returns the model
        to continue with. Default: the donor's model. Push-sum algorithms merge instead (see SGP),
        since the stale node still holds its own share of the mass."""
        return state.tensor.detach().clone().view_as(params)

    def finish(self) -> torch.Tensor | None:
        """Flush in-flight communication at the end of training; returns final parameters, if changed."""
        return None

    def stats(self) -> dict[str, float]:
        """Scalars for metrics and progress lines (e.g. the push-sum weight)."""
        return {}
