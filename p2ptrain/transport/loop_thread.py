"""The one bridge between a caller's thread and an asyncio event loop on a dedicated thread.

grpc.aio objects are not thread-safe: a node's Transport and the parameter server each create and
use theirs on one LoopThread (uvloop when available, installed before any aio object exists). Every
other thread reaches that loop only through `submit`, `call` and `call_soon` here, i.e. through
run_coroutine_threadsafe / call_soon_threadsafe and concurrent.futures.Future.

A `share()` of a LoopThread runs its owner's setup and shutdown on that loop without a thread of its
own (a simulation hosts hundreds of nodes per process on one loop). This module knows nothing of
gRPC, tensors or peers; it must never block the loop it owns.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A uvloop loop when uvloop is installed, else asyncio's default one."""
    try:
        import uvloop
    except ImportError:  # Windows, or uvloop not installed: the default loop works too
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class LoopThread:
    """One event loop running forever on one daemon thread named `name`; `what` names the owner in
    errors and logs ("transport", "parameter server")."""

    def __init__(self, name: str, what: str):
        self.name = name
        self.what = what
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None
        self._tasks: set[asyncio.Task] = set()  # spawned background work, cancelled by stop()
        # submitted from other threads, not yet settled: future -> its coroutine
        self._waited: dict[concurrent.futures.Future, Coroutine] = {}
        self._waited_lock = threading.Lock()
        self._start_lock = threading.Lock()

    @property
    def started(self) -> bool:
        return self.loop is not None

    def start(self, setup: Callable[[], Awaitable[None]], timeout: float = 30.0) -> None:
        """Start the thread, run `setup()` on its loop (e.g. bind and start a server), then serve
        forever. A failure of `setup` (a port in use) is re-raised here, in the caller's thread."""
        ready: concurrent.futures.Future = concurrent.futures.Future()
        self.thread = threading.Thread(target=self._run, args=(setup, ready), name=self.name, daemon=True)
        self.thread.start()
        ready.result(timeout)

    def _run(self, setup: Callable[[], Awaitable[None]], ready: concurrent.futures.Future) -> None:
        loop = self.loop = new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(setup())
        except BaseException as exc:  # noqa: BLE001 - hand any start-up failure to start()
            ready.set_exception(exc)
            loop.close()
            return
        ready.set_result(None)
        try:
            loop.run_forever()
        finally:
            loop.close()
            self._settle_stranded(loop)  # however it stopped: from now on submit() refuses

    def stop(self, shutdown: Callable[[], Awaitable[None]], grace: float) -> None:
        """Run `shutdown()` on the loop (given `grace` + 10 s), cancel spawned tasks, stop the loop
        and join the thread. What other threads still wait on then fails (see _settle_stranded). A
        no-op when never started."""
        loop = self.loop
        if loop is None:
            return
        if loop.is_running():
            self._close(shutdown, grace)
            with contextlib.suppress(RuntimeError):  # closed meanwhile
                loop.call_soon_threadsafe(loop.stop)
        if self.thread is not None:
            self.thread.join(10)

    def _close(self, shutdown: Callable[[], Awaitable[None]], grace: float) -> None:
        """Run `shutdown()` on the loop (given `grace` + 10 s), then cancel this owner's spawned tasks."""
        async def close() -> None:
            try:
                await shutdown()
            finally:
                for task in list(self._tasks):
                    task.cancel()

        try:
            self.submit(close()).result(grace + 10)
        except Exception as exc:  # noqa: BLE001 - shutting down anyway (or it stopped meanwhile)
            log.warning("unclean %s shutdown: %s", self.what, exc)

    def _settle_stranded(self, loop: asyncio.AbstractEventLoop) -> None:
        """Fail what other threads still wait on: the stopped loop will never settle it (a ring
        all-reduce on a communication thread would otherwise wait past the process's end). Close the
        coroutines it never started (submitted, or cancelled, just before it stopped), which Python
        would otherwise report as never awaited."""
        with self._waited_lock:
            stranded, self._waited = self._waited, {}
        _close_unstarted(list(stranded.values()) + [task.get_coro() for task in asyncio.all_tasks(loop)])
        for future in stranded:
            _fail(future, self.what)

    # From any thread ----------------------------------------------------------------------------
    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule `coro` on the loop; its future, to wait on from the caller's thread."""
        if self.loop is None:
            coro.close()
            raise RuntimeError(f"{self.what} not started")
        try:
            future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        except RuntimeError:  # the loop is closed: the coroutine will never run
            coro.close()
            raise
        with self._waited_lock:
            self._waited[future] = coro
        future.add_done_callback(self._settled)
        return future

    def _settled(self, future: concurrent.futures.Future) -> None:
        with self._waited_lock:
            self._waited.pop(future, None)

    def call(self, fn: Callable[..., T], *args, timeout: float | None = None) -> T:
        """fn(*args) run on the loop, where the state it touches lives; its result or exception.
        Before start() nothing else touches that state, so it runs right here."""
        if self.loop is None:
            return fn(*args)
        return self.submit(_invoke(fn, *args)).result(timeout)

    def call_soon(self, fn: Callable[..., object], *args) -> None:
        """Schedule fn(*args) on the loop without waiting for it."""
        if self.loop is None:
            raise RuntimeError(f"{self.what} not started")
        self.loop.call_soon_threadsafe(fn, *args)

    def ensure_running(self, timeout: float = 30.0) -> None:
        """Start the loop, with nothing to set up, unless it runs already (a host of shares)."""
        with self._start_lock:
            if not self.started:
                self.start(_nothing, timeout)

    def share(self, what: str) -> "LoopShare":
        """A handle for another owner (`what`) on this loop: its own tasks and waiters, started and
        stopped on its own, while the loop and its thread stay this LoopThread's."""
        return LoopShare(self, what)

    # On the loop thread -------------------------------------------------------------------------
    def spawn(self, coro: Coroutine) -> asyncio.Task:
        """Run `coro` in the background; stop() cancels it if it is still running then."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


class LoopShare(LoopThread):
    """One owner's part of a host LoopThread's loop (LoopThread.share). start() starts the host if
    it is not running yet and runs `setup` there; stop() runs `shutdown`, cancels this share's tasks
    and fails what still waits on it, and leaves the loop running for the other shares."""

    def __init__(self, host: LoopThread, what: str):
        super().__init__(host.name, what)
        self.host = host

    def start(self, setup: Callable[[], Awaitable[None]], timeout: float = 30.0) -> None:
        self.host.ensure_running(timeout)
        self.loop, self.thread = self.host.loop, self.host.thread
        try:
            self.submit(setup()).result(timeout)
        except BaseException:
            self.loop = self.thread = None
            raise

    def stop(self, shutdown: Callable[[], Awaitable[None]], grace: float) -> None:
        loop = self.loop
        if loop is None:
            return
        if loop.is_running():
            self._close(shutdown, grace)
        self.loop = self.thread = None  # submit() refuses from here on
        with self._waited_lock:
            stranded, self._waited = self._waited, {}
        _close_unstarted(list(stranded.values()))
        for future in stranded:  # (cancelling the future cancels its task on the loop)
            future.cancel() or _fail(future, self.what)


def _close_unstarted(coros: list) -> None:
    """Close the coroutines a loop never started (Python would report them as never awaited)."""
    for coro in coros:
        if inspect.iscoroutine(coro) and inspect.getcoroutinestate(coro) == inspect.CORO_CREATED:
            coro.close()


def _fail(future: concurrent.futures.Future, what: str) -> None:
    try:
        future.set_exception(RuntimeError(f"{what} stopped"))
    except concurrent.futures.InvalidStateError:  # settled meanwhile
        pass


async def _nothing() -> None:
    return None


async def _invoke(fn: Callable[..., T], *args) -> T:
    return fn(*args)


__all__ = ["LoopShare", "LoopThread", "new_event_loop"]
