"""How a node's training ends other than by finishing: a failed run, or a graceful leave."""
from __future__ import annotations


class NonFiniteError(FloatingPointError):
    """The loss or the model became NaN/Inf at `step`: the run has failed (the summary says where)."""

    def __init__(self, rank: int, step: int, what: str):
        super().__init__(f"node {rank}: non-finite {what} at step {step}")
        self.rank, self.step, self.what = rank, step, what


class LeftCluster(SystemExit):
    """This node left the cluster gracefully (SIGTERM in an elastic run, or request_leave()): raised
    by step() once it handed over what it held; exits with code 0 unless caught."""

    def __init__(self, rank: int, step: int):
        super().__init__(0)
        self.rank, self.step = rank, step

    def __str__(self) -> str:
        return f"node {self.rank} left the cluster at step {self.step}"


__all__ = ["LeftCluster", "NonFiniteError"]
