"""What an algorithm is to the engine (Bagua-style hooks; the engine owns the loop), and what the
node is to an algorithm (the typed `Comm` protocol).

The training engine keeps the model's parameters in one flat buffer. It calls `setup` once and
`after_step` after every local optimizer step (`reduce_gradients` after backward for algorithms that
set `uses_gradients`), and loads whatever flat vector the algorithm returns into the model before
the next forward pass. An algorithm holds its source's math and talks to peers only through
`Comm`: it never opens a socket, never sees the wire format, and imports no torch at module level
(it does math on the tensors it is handed), so the registry stays light.
"""
from __future__ import annotations

import concurrent.futures
import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Protocol

if TYPE_CHECKING:
    import torch


class Kind(enum.IntEnum):
    """What a message means to the algorithm that receives it (the transport routes by it; the
    values are the wire's MessageKind, checked by a test)."""

    PUSH_SUM = 1    # SGP: p * x, with p * w as the message's ps_weight
    GOSSIP = 2      # D-PSGD: a neighbour's model
    ALLREDUCE = 3   # one segment of a ring all-reduce
    RELAY = 4       # RelaySum message, its counter as relay_count
    STATE = 5       # a (re)joining peer's state transfer
    LEAVE = 9       # a leaving node's whole push-sum mass, handed to a member that stays


@dataclass(frozen=True)
class Delivery:
    """How a send ended: delivered (a duplicate of a delivered copy counts), or refused with the
    receiver's reason (e.g. "stale_step"; "voided": settled as never delivered)."""

    delivered: bool
    reason: str = ""
    detail: str = ""


class Received(Protocol):
    """A message handed to an algorithm; `tensor` may view a pooled buffer: call release() once used."""

    sender: int
    step: int
    tensor: "torch.Tensor"
    ps_weight: float
    relay_count: float
    codec: int
    codec_params: tuple[float, ...]

    def release(self) -> None: ...


class Members(Protocol):
    """Who trains together and who is alive, as an algorithm sees it (the transport's Membership)."""

    def view_order(self) -> tuple[int, int]:
        """The latest view's order (epoch, proposer): it changes exactly when a view is adopted."""

    def members(self, step: int) -> tuple[int, ...]:
        """The ranks training together at `step` (all of them, unless nodes joined or left)."""

    def placed(self, step: int) -> tuple[int, ...]:
        """The members at `step` in the order rings and graphs lay them out (rank order, unless the
        runtime placed private peers apart: transport/membership/placement.py)."""

    def switches_at(self, step: int) -> bool:
        """The members at `step` differ from those at step - 1."""

    def first_switch(self, after: int, until: int) -> int | None:
        """The first step in (after, until] at which the members change (None: none)."""

    def entering(self, step: int) -> tuple[int, ...]:
        """Members that enter at `step`'s switch with a donor's copy (new in its view): the others
        hand them the members' state there (() where no view switches)."""

    def departing(self, step: int) -> frozenset[int]:
        """Members at `step` that a pending view drops without their own say (they died)."""

    def split_members(self, step: int) -> tuple[int, ...] | None:
        """The members that some nodes hold at `step` by a view this node refused (an eviction of
        a peer alive here); None when there is none."""

    def live(self, peers: Iterable[int]) -> list[int]:
        """The peers neither dead nor lagging: send to and wait for these only."""

    def accept_leave(self, peer: int, weight: float) -> str:
        """"" if the mass `weight` that leaving `peer` hands over may be absorbed (once), else why not."""

    def all_alive(self) -> bool: ...

    def dead(self) -> frozenset[int]:
        """The peers this node declared dead."""

    def finished(self) -> frozenset[int]:
        """The peers that said their run is over (they take part in no collective any more)."""

    def asking_for_state(self) -> frozenset[int]:
        """Peers that gave their state up and wait for ours (a catch-up or a restart asked): a
        collective that waits for them cannot complete before this node serves them."""

    def entered(self, peer: int, step: int) -> None:
        """`peer` took the members' state from this node at `step`'s switch: await it from there."""

    def peer_step(self, peer: int, heard_since: int | None = None) -> int | None:
        """The latest step `peer` was heard at (None: never heard from, or with `heard_since`,
        not since this node was at that step)."""

    def sent_step(self, peer: int, kind: int) -> int | None:
        """The latest step of a `kind` message from `peer`, its own step (None: none came)."""

    def seconds_for_lag(self, lags: int = 1) -> float:
        """About how long this node takes for `lags` lag limits of steps (0.0 before it has a pace)."""

    def drop_dead_members(self) -> None:
        """Propose the members without the peers this node declared dead."""

    def realign(self) -> None:
        """Propose the same members again (a ring whose nodes fell out of step re-forms)."""


class Comm(Protocol):
    """The node as an algorithm sees it."""

    rank: int
    world_size: int
    membership: Members
    joined: Received | None  # the state a restarted node took from a donor (None: a fresh start)

    @property
    def link_deadline(self) -> float: ...

    peer_timeout: float  # seconds before a silent peer counts as gone (a barrier waits this long)

    def expect(self, kind: Kind, dtype: "torch.dtype", numel: int, *, channel: str | None = None,
               preallocate: int = 2, max_payload_bytes: int | None = None, codecs=None, peak: bool = False) -> None:
        """Accept messages of `kind` (on `channel`) holding `numel` x `dtype`; call before ready().
        `peak`: each raw float message carries its max |v|, measured as it arrived (Message.peak)."""

    def unexpect(self, kind: Kind, channel: str | None = None) -> None:
        """Refuse `kind` messages from now on (a leaver takes no other leaver's mass)."""

    def ready(self, neighbours: Iterable[int] | None = None) -> None:
        """Every expect() done: announce readiness and wait for the peers to be ready too (where
        the transport meets only neighbours: those of `neighbours`, the peers this algorithm
        sends to or hears from; None: every peer)."""

    def set_step(self, step: int) -> None: ...

    def host(self, peer: int) -> str:
        """The host `peer`'s address names ("" when unknown): nodes naming one host share its CPUs and network."""

    def host_region(self, nbytes: int):
        """A region of `nbytes` of shared memory that the peers of this host can map read-only, with
        a mark its owner publishes (transport/host_memory.py: OwnRegion), or None where there are none."""

    def map_host_region(self, offer: tuple[int, int, int], nbytes: int):
        """A peer's region from its OwnRegion.offer (PeerRegion); ValueError where it cannot be mapped."""

    def make_room(self, peer: int, window: int) -> bool:
        """True once fewer than `window` sends to `peer` await their acknowledgement (a stalled
        peer gets skipped instead of piling up messages)."""

    def send(self, peer: int, tensor: "torch.Tensor", *, kind: Kind, step: int, **header) -> concurrent.futures.Future:
        """Push `tensor` (not modified afterwards); a future of its Delivery."""

    def gather(self, kind: Kind, step: int, senders: list[int], *, channel: str = "",
               deadline: float | None = None, abandon: Callable[[], str | None] | None = None,
               laggards: bool = False) -> dict[int, Received]:
        """The step-`step` messages of the live senders that arrive within the link deadline.
        `abandon`: says why waiting on is hopeless (or None); checked while waiting, on the
        transport's thread, it ends the wait early. `laggards`: wait for lagging senders too."""

    def receive_into(self, peer: int, kind: Kind, step: int, tensor: "torch.Tensor | None", *,
                     channel: str = "") -> bool:
        """Have `peer`'s step-`step` message of `kind` land straight in `tensor` (its size; no
        copy, no page faults while it arrives); None forgets it. False where it cannot (CUDA)."""

    def take(self, kind: Kind, max_step: int, *, channel: str = "") -> list[Received]:
        """Messages of steps <= max_step that already arrived (late ones)."""

    def background(self, fn, *args, **kwargs) -> concurrent.futures.Future:
        """Run fn(*args, **kwargs) on the engine's communication worker, after every job submitted
        before it (one thread per node, FIFO); a future of its result. Algorithms overlap
        communication with compute through this and never start threads of their own."""


class MassSink(Protocol):
    """Where a push-sum algorithm notes the mass it holds whenever it moves (train/mass_record.py):
    a record that survives a SIGKILL, so a killed node's loss can be accounted for."""

    def held(self, step: int, w: float, in_flight: float, taken: float, minted: float = 0.0,
             flows: tuple[float, float, float, float, float] = (0.0,) * 5) -> None:
        """w held, w sent and not yet acknowledged, w taken from the inbox so far, and the new
        units this process started with (a fresh joiner or restart)."""


class Algorithm(ABC):
    name = "algorithm"
    uses_gradients = False  # True: the engine calls reduce_gradients after every backward
    elastic = False         # True: nodes may join and leave while it runs (welcome / hand_over, views)
    holds_mass = False      # True: push-sum mass w, Σ w = the member count (watch_mass)
    # True: every member's inner optimizer state ends with the same bits too (gradients averaged
    # over a ring that averages the optimizer state at its switches); the node reports its digest
    shares_optimizer_state = False
    comm: Comm

    @abstractmethod
    def setup(self, params: "torch.Tensor") -> "torch.Tensor":
        """Called once with the initial flat parameters; returns the parameters to compute with."""

    @abstractmethod
    def after_step(self, step: int, params: "torch.Tensor") -> "torch.Tensor":
        """`params` = model after the local optimizer step of `step`; returns the model for step+1
        (which may be `params` itself, written in place: the engine then copies nothing)."""

    def watch_gradients(self, params: list, next_step) -> None:
        """The model's parameters (in the flat vector's order) and `next_step()`, the step the next
        backward belongs to, for algorithms that start communicating from backward hooks while
        backward still runs (bucketed all-reduce). Called once, before setup. Default: nothing."""

    def watch_optimizer_state(self, numel: int, dtype: "torch.dtype") -> None:
        """The inner optimizer's state can be read as a vector of `numel` values of `dtype`
        (train/optimizer_state.py). Called once, before setup, so the algorithm can declare what
        it will receive for it. Default: nothing."""

    def resync_optimizer_state(self, step: int, state: "torch.Tensor") -> "torch.Tensor | None":
        """A new view takes effect at `step` (after members_changed): the optimizer state to continue
        with, or None to keep `state`. Rings average it with the model, so their members stay
        bit-identical. Default: None."""
        return None

    def members_changed(self, step: int, params: "torch.Tensor") -> "torch.Tensor | None":
        """A new view takes effect at `step` (nodes joined or left; the engine calls this before
        the step's hooks); returns new parameters if the algorithm changed them. Default: nothing
        (graphs follow Comm.members by themselves); rings re-form and re-synchronize here, after
        completing any round still in flight and before telling peers they are at `step`
        (Comm.set_step): a ring member heard at a switch step runs no earlier round any more."""
        return None

    def reduce_gradients(self, step: int, grads: "torch.Tensor") -> "torch.Tensor | None":
        """Flat local gradient of `step`: the engine's gradient buffer, which it rewrites after this
        returns (copy what you keep past the call); returns the gradient to apply, or None to skip
        this step's optimizer update."""
        return grads

    def donate_state(self, peer: int, step: int, params: "torch.Tensor") -> "torch.Tensor | None":
        """Send this node's state to a (re)joining `peer` (called by the engine at a step boundary,
        with the current parameters); returns new parameters if donating changed them. Default:
        a copy of the model; push-sum algorithms split their mass instead (see SGP)."""
        self.comm.send(peer, params.detach().clone(), kind=Kind.STATE, step=step, ps_weight=1.0, reliable=True)
        return None

    def welcome(self, peer: int, step: int, params: "torch.Tensor") -> "torch.Tensor | None":
        """Send a node that joins the cluster (a new member) its start state; returns new parameters
        if that changed them. Default: as donate_state. Push-sum algorithms hand it a new unit of
        mass instead of half of theirs, so Σ w stays the member count (see SGP)."""
        return self.donate_state(peer, step, params)

    def hand_over(self, members: list[int], step: int) -> None:
        """This node leaves after `step` (finish() was called): give what it holds that the others
        need to a member that stays. Default: nothing (a model copy is no one's loss); push-sum
        algorithms hand their whole mass to one of `members`."""

    def adopt_state(self, state: Received, params: "torch.Tensor") -> "torch.Tensor":
        """A node that stalled and fell behind caught up: `state` is a donor's state transfer,
        `params` the stale local model; returns the model to continue with. Default: the donor's
        model. Push-sum algorithms merge instead (see SGP), since the stale node still holds its
        own share of the mass."""
        return state.tensor.detach().clone().view_as(params)

    def state_dict(self) -> dict:
        """The algorithm's own state for a checkpoint, taken at a step boundary on every node (the
        engine stores it beside the optimizer's). Fold in-flight messages in first, so nothing that
        is on the wire is lost by stopping. Default: nothing."""
        return {}

    def load_state_dict(self, state: dict, step: int) -> "torch.Tensor | None":
        """Resume from state_dict(): `step` is the next step to run; the cluster resumes together
        (peers loaded the same checkpoint step). Returns the parameters to compute with when the
        algorithm holds them (SGP: z = x / w), else None. Default: nothing to restore."""
        return None

    def finish(self) -> "torch.Tensor | None":
        """Flush in-flight communication at the end of training; returns final parameters, if changed."""
        return None

    def agree_at_end(self, step: int, params: "torch.Tensor") -> "torch.Tensor | None":
        """After finish(), at the final step on every member: bring the members' shared state
        together again if faults left it apart (rings: a round some member skipped). Must change
        nothing in a fault-free run. None: nothing to change."""
        return None

    def apart_at_end(self) -> bool:
        """Faults left this node's shared state apart from the members' (rings: a round failed or
        was skipped here since they last averaged): before agree_at_end the node then waits for
        members far behind (Lifecycle.await_members_at_end). False in a fault-free run."""
        return False

    def stats(self) -> dict[str, float]:
        """Scalars for metrics and progress lines (e.g. the push-sum weight)."""
        return {}

    def mass_flows(self) -> dict[str, float] | None:
        """Push-sum algorithms: the cumulative flows of w (PushSum.flow_totals) for the node's
        summary, which the launcher's exact mass ledger adds up; None for the others."""
        return None

    def shared_state(self, params: "torch.Tensor") -> "tuple[str, torch.Tensor] | None":
        """(name, tensor) of what must be the same bits on every final member once finish() ran,
        given the final model `params`: a ring's model, DiLoCo's anchor. The node writes its digest
        into the summary so a chaos run can check the invariant; None where nothing must agree
        (gossip only converges)."""
        return None

    def watch_mass(self, sink: MassSink) -> None:
        """Algorithms that hold push-sum mass (holds_mass) note it in `sink` whenever it moves.
        Called once, before setup. Default: nothing to note."""


def buffer_like(tensor: "torch.Tensor") -> "torch.Tensor":
    """An uninitialized tensor shaped like `tensor`, for buffers an algorithm reuses from step to
    step, the ones it sends from among them: on 2 MiB pages where large (large_pages.py; imported
    here, not at module level: the registry loads without torch)."""
    from p2ptrain.large_pages import empty_like

    return empty_like(tensor)


def send_failure(future: concurrent.futures.Future) -> BaseException | None:
    """Why a finished send failed (None if it completed): its exception, or CancelledError for a
    send the transport cancelled (future.exception() would raise that instead of returning it)."""
    if future.cancelled():
        return concurrent.futures.CancelledError("send cancelled")
    return future.exception()


def delivery_failure(future: concurrent.futures.Future) -> str | None:
    """How a finished send of Delivery failed ("failed: …" or "refused: …"), None if delivered."""
    exc = send_failure(future)
    if exc is not None:
        return f"failed: {exc}"
    outcome = future.result()
    return None if outcome.delivered else f"refused: {outcome.reason}: {outcome.detail}"


__all__ = ["Algorithm", "Comm", "Delivery", "Kind", "MassSink", "Members", "Received", "buffer_like",
           "delivery_failure", "send_failure"]
