"""The engine's communication worker: one thread per node that runs background collectives.

Overlap belongs to the engine (Bagua's rule): an algorithm asks for it through
`Comm.background(fn, *args)` and never starts a thread of its own. Jobs run one at a time, in
submission order, so two algorithms' rings (or one algorithm's buckets) are entered in the same
order on every node, and a job may rely on the jobs submitted before it having finished. A job
must never wait for a job submitted after it (there is one thread: it would wait forever).

The thread starts with the first job and is a daemon: a node that never closes its communicator
does not keep the interpreter alive. close() (the node's, at the end) refuses new jobs, cancels
those not started and joins the one running, which ends once the transport has stopped (its waits
fail then: transport/loop.py).
"""
from __future__ import annotations

import concurrent.futures
import queue
import threading
from typing import Any, Callable

_STOP = object()


class CommWorker:
    """A single-thread FIFO executor named `name` (threads show it in dumps and tests)."""

    def __init__(self, name: str = "comm-worker"):
        self.name = name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        """Run fn(*args, **kwargs) on the worker after every job submitted before; a future of its
        result (or of the exception it raised)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name} is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._jobs.put((future, fn, args, kwargs))
        return future

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            future, fn, args, kwargs = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(exc)
            else:
                future.set_result(result)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, timeout: float | None = None) -> None:
        """Refuse new jobs, cancel the queued ones and wait (up to `timeout`) for the one running.
        Idempotent; a no-op on a worker that never ran a job."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        if thread is None:
            return
        while True:  # cancel what has not started (the thread skips cancelled jobs)
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not _STOP:
                job[0].cancel()
        self._jobs.put(_STOP)
        if thread is not threading.current_thread():
            thread.join(timeout)


__all__ = ["CommWorker"]
