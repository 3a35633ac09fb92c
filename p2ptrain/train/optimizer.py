"""p2ptrain.DecentralizedOptimizer: any torch optimizer, made decentralized.

`step()` runs the wrapped optimizer's local step between the algorithm's hooks (the engine's job;
the algorithm owns the math, Bagua style): gradient reduction before it (all-reduce of gradients,
Pipe-SGD), model mixing after it (SGP, D-PSGD, RelaySGD, model all-reduce). The model's parameters
and floating buffers (BatchNorm statistics) travel as one flat vector (p2ptrain.train.state.ModelState).
Never: a step that skips the communication its peers wait for (an overflowed GradScaler step still
reaches step()), or a run that goes on with a non-finite model. Usage: DecentralizedOptimizer.
"""
from __future__ import annotations

import logging
import math
import signal
import threading
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from p2ptrain import session
from p2ptrain.train.elastic import Lifecycle
from p2ptrain.train.errors import LeftCluster, NonFiniteError
from p2ptrain.train.optimizer_state import OptimizerStateVector
from p2ptrain.train.state import ModelState
from p2ptrain.transport.validation import all_finite

if TYPE_CHECKING:
    from p2ptrain.algorithms.base import Algorithm
    from p2ptrain.communicator import Communicator

log = logging.getLogger(__name__)
CHECKPOINT_FORMAT = "p2ptrain.DecentralizedOptimizer/1"


class DecentralizedOptimizer(torch.optim.Optimizer):
    """Wraps `optimizer` (any torch.optim.Optimizer over `model`'s parameters) for the node's
    algorithm. `node`: a node from p2ptrain.init() (default: the one init() made); or pass the
    `algorithm` and `comm` yourself. `sync_buffers=False` keeps buffers local.

        node = p2ptrain.init()
        opt = p2ptrain.DecentralizedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-4), model=model, node=node)
        for step, (x, y) in enumerate(loader):
            loss = loss_fn(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step(); scheduler.step(); opt.zero_grad(set_to_none=True)
        opt.finish()

    The wrapper is itself a torch Optimizer sharing the inner one's param_groups and state, so LR
    schedulers (on either), clip_grad_norm_, gradient accumulation (step every k micro-batches),
    zero_grad(set_to_none=True), parameter groups and optimizers with state keep working. With a
    GradScaler, `scaler.step(opt)` always reaches step() (`_step_supports_amp_scaling`): an
    overflowed step skips the local update but not the communication peers wait for (with gradient
    averaging the node contributes zeros and applies the same average as everyone, so models stay
    identical). It also does what a node needs around the algorithm: it resumes a restarted node
    from a live peer, gives its state to joiners at step boundaries, catches up after a stall,
    refuses to go on with a non-finite model, and checkpoints (state_dict: the inner optimizer, the
    step and the algorithm's own state, e.g. SGP's x and w)."""

    _step_supports_amp_scaling = True  # GradScaler.step(opt) calls step() even on overflow (see step)

    def __init__(self, optimizer: torch.optim.Optimizer, *, model: nn.Module, node=None,
                 algorithm: Algorithm | None = None, comm: Communicator | None = None, sync_buffers: bool = True,
                 metrics=None):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"DecentralizedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, DecentralizedOptimizer):
            raise TypeError("this optimizer is already decentralized")
        if node is None and algorithm is None:
            node = session.current_node()  # raises a clear error before p2ptrain.init()
        _check_ownership(optimizer, model)
        self.node = node
        self.optimizer = optimizer
        self.model = model
        self.algorithm = algorithm if algorithm is not None else node.algorithm()
        self.comm = comm if comm is not None else (node.comm if node is not None else None)
        self.metrics = metrics if metrics is not None else (node.metrics if node is not None else None)
        self.rank = self.comm.rank if self.comm is not None else 0
        self.state_vector = ModelState(model, buffers=sync_buffers)
        super().__init__([p for group in optimizer.param_groups for p in group["params"]], optimizer.defaults)
        self.param_groups = optimizer.param_groups  # one set of groups: schedulers and clipping act on both
        self.state = optimizer.state
        self.local_step = 0           # the next step to run
        self.start_step = 0           # where this process started (a restarted node resumes a peer's step)
        self.skipped_steps = 0        # local updates skipped on a GradScaler overflow
        self._finished = False
        self._finite_at: int | None = None  # the step whose model check_finite already proved finite
        self._step_listeners: list = []
        # joins, leaves, rejoins and catch-ups (train/elastic.py); None without a communicator
        self.lifecycle = Lifecycle(self.comm, self.algorithm, self.state_vector, self.metrics) \
            if self.comm is not None else None
        if node is not None and self.lifecycle is not None and node.config.elastic \
                and getattr(self.algorithm, "elastic", False):
            _leave_on_sigterm(self)  # before a join's state transfer: a leave may come while it waits
        # the inner optimizer's state, which rings average with the model when their members change
        self.optimizer_state = OptimizerStateVector.of(optimizer)
        if self.optimizer_state is not None:
            self.algorithm.watch_optimizer_state(self.optimizer_state.numel, self.optimizer_state.dtype)
        self._setup()
        if node is not None:
            node.attach(self)

    # Start: a (re)joining node takes a live peer's state; then the algorithm sets up ----------------
    def _setup(self) -> None:
        state, lifecycle = self.state_vector, self.lifecycle
        if lifecycle is not None:
            self.local_step = lifecycle.join()
        self.algorithm.watch_gradients(state.params, lambda: self.local_step)
        state.load(self.algorithm.setup(state.vector()))  # (a rejoining node announces itself here)
        if lifecycle is not None:
            self.local_step = lifecycle.joined(self.local_step)
        self.start_step = self.local_step

    def add_step_listener(self, listener) -> None:
        """Call `listener(optimizer)` after every step (the node records progress and metrics)."""
        self._step_listeners.append(listener)

    @property
    def catch_ups(self) -> int:
        """State transfers taken after stalling (train/elastic.py)."""
        return self.lifecycle.catch_ups if self.lifecycle is not None else 0

    @property
    def leave_at(self) -> int | None:
        """The step the members switch to a view without this node (once it asked to leave)."""
        return self.lifecycle.leave_at if self.lifecycle is not None else None

    def summary(self) -> dict[str, Any]:
        """This optimizer's part of the node's summary."""
        return {"start_step": self.start_step, "catch_ups": self.catch_ups, "skipped_steps": self.skipped_steps,
                "rejoined": bool(self.start_step > 0 and self.comm is not None and self.comm.joined is not None),
                "join_timeline": dict(self.lifecycle.timeline) if self.lifecycle is not None else {}}

    # The step ----------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """One decentralized step: the algorithm's gradient hook, the local update, its mixing hook."""
        if closure is not None:
            raise ValueError("DecentralizedOptimizer.step() takes no closure: compute the loss and call "
                             "backward() before step()")
        if self._finished:
            raise RuntimeError("step() after finish(): this optimizer's run is over")
        step, state, algorithm = self.local_step, self.state_vector, self.algorithm
        if self.comm is not None and self.comm.membership.switches_at(step):  # nodes joined or left: a ring re-forms
            # both vectors first, both exchanges back to back, then both loads: a node handed the
            # members' state waits idle while the two arrive, instead of copying between them
            optimizer_state = self.optimizer_state.vector() if self.optimizer_state is not None else None
            changed = algorithm.members_changed(step, state.vector())
            synced = algorithm.resync_optimizer_state(step, optimizer_state) if optimizer_state is not None else None
            if changed is not None:
                state.load(changed)
            if synced is not None:
                self.optimizer_state.load(synced)
        overflowed = self._unscale_for_grad_scaler()
        if algorithm.uses_gradients:
            vector = state.gradient_vector()
            if overflowed:  # contribute nothing; apply the same average as everybody (models stay equal)
                vector[:state.num_params].zero_()
            reduced = algorithm.reduce_gradients(step, vector)
            if reduced is not None:  # None: nothing to apply yet (the first pipelined Pipe-SGD step)
                state.load_gradient_vector(reduced)
                self.optimizer.step()
        elif not overflowed:
            self.optimizer.step()
        state.load(algorithm.after_step(step, state.vector()))
        lifecycle = self.lifecycle
        if lifecycle is not None:
            lifecycle.serve_joiners(step)
        self.check_finite(step, "model")
        next_step = step + 1
        if lifecycle is not None:
            leave_at = lifecycle.leave_due(step)
            if leave_at is not None:
                self._leave(step, leave_at)
            lifecycle.keep_pace(step)
            lifecycle.hold_back(step)
            next_step = lifecycle.catch_up(step)  # (a state it loads, it checks)
            lifecycle.step_done()
        self.local_step = self._finite_at = next_step
        self._step_done()
        return None

    def request_leave(self) -> None:
        """Leave the cluster gracefully (what SIGTERM does in an elastic run): at the next step
        boundary the node proposes the members without itself, trains up to the step they switch
        at, hands over what it holds (push-sum mass) to a member that stays, and step() raises
        LeftCluster (a SystemExit with code 0)."""
        if self.lifecycle is None:
            raise RuntimeError("leaving needs a node: this optimizer has no communicator")
        self.lifecycle.request_leave()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As the inner optimizer's; for an algorithm that reduces gradients the flat gradient
        buffer is zeroed in place instead (every parameter gets a gradient there anyway), so the next
        backward accumulates into it and nothing is copied or allocated (DDP's gradient_as_bucket_view)."""
        if self.algorithm.uses_gradients and self.state_vector.zero_gradients():
            return
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def finish(self) -> None:
        """End of training: flush the algorithm's in-flight communication (push-sum mass, the last
        pipelined all-reduce) so no peer waits for us and nothing is left on the wire, then let the
        members agree again if faults left them apart (Algorithm.agree_at_end: rings average the
        models once more if a round failed anywhere; nothing changes in a fault-free run)."""
        if self._finished:
            return
        self._end_training()
        self._say_finished()

    def _end_training(self) -> None:
        final = self.algorithm.finish()
        if final is not None:
            self.state_vector.load(final)
        if self.comm is not None:
            if self.lifecycle is not None and self.algorithm.apart_at_end():
                self.lifecycle.await_members_at_end(self.local_step)
            agreed = self.algorithm.agree_at_end(self.local_step, self.state_vector.vector())
            if agreed is not None:
                self.state_vector.load(agreed)
                if self.optimizer_state is not None:  # (rings: with the models, the optimizer states)
                    synced = self.algorithm.resync_optimizer_state(self.local_step, self.optimizer_state.vector())
                    if synced is not None:
                        self.optimizer_state.load(synced)
        self._finished = True

    def _say_finished(self) -> None:
        if self.comm is not None:
            self.comm.membership.finish()  # no state to give from here on
        self.check_finite(self.local_step, "final model")

    # Checkpoints -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state, the step and the algorithm's own state (e.g. SGP's x and w,
        after folding in what is in flight). Call it on every node at the same step, as with DDP;
        save the model's own state_dict beside it."""
        return {"format": CHECKPOINT_FORMAT, "step": self.local_step, "optimizer": self.optimizer.state_dict(),
                "algorithm": {"name": self.algorithm.name, **self.algorithm.state_dict()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from state_dict() (after loading the model's state): the next step() runs the
        saved step; peers that resume too are waited for, so nobody's first messages are refused."""
        if state_dict.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"not a DecentralizedOptimizer checkpoint (format {state_dict.get('format')!r})")
        algorithm_state = dict(state_dict["algorithm"])
        name = algorithm_state.pop("name")
        if name != self.algorithm.name:
            raise ValueError(f"the checkpoint is of algorithm {name}, this node runs {self.algorithm.name}")
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self.local_step = self.start_step = int(state_dict["step"])
        self._finite_at = None
        params = self.algorithm.load_state_dict(algorithm_state, self.local_step)
        if params is not None:
            self.state_vector.load(params)
        if self.comm is not None:
            # a peer still at step 0 would refuse our messages as too far in its future: wait for all
            self.comm.set_step(self.local_step)
            self.comm.membership.wait_for_step(self.local_step, self.comm.peer_timeout)

    # Around the algorithm ----------------------------------------------------------------------
    def check_finite(self, step: int, what: str, loss: float | None = None) -> None:
        """Raise NonFiniteError (the run has failed) for a NaN/Inf loss or model. The model check
        (a pass over it) is skipped at a step's loss check when step() proved that very model
        finite at the end of the step before: the trainer checks the loss every step."""
        if loss is not None and not math.isfinite(loss):
            raise NonFiniteError(self.rank, step, "loss")
        if loss is not None and step == self._finite_at:
            return
        if not all_finite(self.state_vector.vector()):  # one sum, not a boolean tensor of the model
            raise NonFiniteError(self.rank, step, what)

    def _unscale_for_grad_scaler(self) -> bool:
        """With GradScaler.step(self): unscale the gradients (unless the user did, e.g. to clip) and
        say whether they overflowed. Without a scaler: False."""
        found_inf = getattr(self, "found_inf", None)
        if found_inf is None:
            return False
        scale = getattr(self, "grad_scale", None)
        if scale is not None:  # GradScaler checked but did not unscale: the contract leaves it to us
            inverse = 1.0 / scale
            for p in self.state_vector.params:
                if p.grad is not None:
                    p.grad.mul_(inverse.to(p.grad.device, p.grad.dtype))
        overflowed = bool(found_inf.item() > 0)
        self.skipped_steps += overflowed
        return overflowed

    def _leave(self, step: int, leave_at: int) -> None:
        """After the last step as a member: finish the algorithm, hand over to a member that stays,
        and raise LeftCluster."""
        log.info("node %d: leaving the cluster after step %d; the others go on without it", self.rank, step)
        if not self._finished:
            self._end_training()
        # (it says it finished once its mass is handed over: the member it tries first waits for
        # that mass at its own finish until it has it or hears so, Membership.leaves_due)
        self.lifecycle.hand_over(leave_at)
        self._say_finished()
        self.local_step = step + 1
        self._step_done()
        raise LeftCluster(self.rank, step + 1)

    def _step_done(self) -> None:
        for listener in self._step_listeners:
            listener(self)


def _leave_on_sigterm(optimizer: DecentralizedOptimizer) -> None:
    """SIGTERM (docker stop, kubectl delete, Slurm preemption, `launch --leave`) asks `optimizer`
    to leave gracefully; a second SIGTERM terminates as before. Only the main thread installs
    signal handlers; elsewhere call request_leave() yourself."""
    if threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum, frame) -> None:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        log.warning("node %d: SIGTERM: leaving the cluster at the next step boundary", optimizer.rank)
        optimizer.request_leave()

    signal.signal(signal.SIGTERM, on_sigterm)


def _check_ownership(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """Every parameter the optimizer updates must be one of the model's (they are averaged together)."""
    owned = {id(p) for p in model.parameters()}
    stranger = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in owned]
    if stranger:
        raise ValueError(f"the optimizer updates {len(stranger)} tensor(s) that are not parameters of the model "
                         "given: build it over model.parameters()")
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    left = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in optimized]
    if left:
        log.warning("the optimizer does not update the model's trainable parameter(s) %s; they are averaged but "
                    "never trained here", ", ".join(left[:5]) + (" ..." if len(left) > 5 else ""))


__all__ = ["DecentralizedOptimizer", "LeftCluster", "NonFiniteError", "CHECKPOINT_FORMAT"]
