"""LoopThread, the bridge between a caller's thread and a transport's event loop: what other threads
submitted when it stops is failed (no waiter is left hanging) and, if it never ran, closed (Python
never reports a coroutine that was never awaited)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import threading
import time
import warnings

import pytest

from p2ptrain.transport.loop_thread import LoopThread


async def _nothing() -> None:
    return None


def test_stop_fails_what_waits_and_closes_the_coroutines_that_never_ran():
    thread = LoopThread("test-loop", "test loop")
    thread.start(_nothing)
    loop, gate = thread.loop, threading.Event()
    thread.call_soon(gate.wait, 10)  # hold the loop: what is submitted now cannot run before it stops
    waiting = [thread.submit(_nothing()) for _ in range(3)]
    given_up = thread.submit(_nothing())
    given_up.cancel()  # a sender that timed out
    loop.call_soon_threadsafe(loop.stop)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gate.set()
        thread.stop(_nothing, grace=1)  # (the loop stops on its own meanwhile)
        gc.collect()
    for future in waiting:
        with pytest.raises(RuntimeError, match="test loop stopped"):
            future.result(1)
    assert not [w for w in caught if "never awaited" in str(w.message)], [str(w.message) for w in caught]


def test_a_stopped_loop_refuses_new_work_with_a_clear_error():
    thread = LoopThread("test-loop", "test loop")
    with pytest.raises(RuntimeError, match="test loop not started"):
        thread.submit(_nothing())
    thread.start(_nothing)
    thread.stop(_nothing, grace=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError):
            thread.submit(_nothing())
        gc.collect()
    assert not [w for w in caught if "never awaited" in str(w.message)]


def test_call_runs_on_the_loop_thread_and_fails_when_the_loop_stops_before_it_ran():
    """call(): its result or exception comes back, it runs on the loop's thread, and a call made as
    the loop stops runs or fails, never waits forever."""
    thread = LoopThread("test-loop", "test loop")
    thread.start(_nothing)
    assert thread.call(threading.current_thread) is thread.thread
    with pytest.raises(ZeroDivisionError):
        thread.call(lambda: 1 / 0)
    loop, gate, outcome = thread.loop, threading.Event(), []

    def hold_then_stop() -> None:  # the loop stops while the call is queued behind this
        gate.wait(10)
        loop.stop()

    thread.call_soon(hold_then_stop)

    def caller() -> None:
        try:
            outcome.append(thread.call(lambda: "ran", timeout=10))
        except RuntimeError as exc:
            outcome.append(exc)

    waiting = threading.Thread(target=caller)
    waiting.start()
    time.sleep(0.3)  # (the call is queued behind the held loop)
    gate.set()
    thread.stop(_nothing, grace=1)
    waiting.join(10)
    assert not waiting.is_alive()  # it ran (the loop finished the batch it was in) or failed: never left waiting
    assert outcome == ["ran"] or ("test loop stopped" in str(outcome[0]) or "closed" in str(outcome[0])), outcome
    with pytest.raises(RuntimeError):
        thread.call(lambda: "too late")


def test_shares_run_on_one_loop_and_stop_alone():
    """LoopThread.share(): owners on one loop (a simulation's nodes). Each share runs its setup
    there; stopping one fails what still waits on it, cancels its own tasks and refuses new work,
    while the loop and the other shares go on."""
    host = LoopThread("test-host", "host loop")
    first, second = host.share("first node"), host.share("second node")
    first.start(_nothing)
    second.start(_nothing)
    assert first.call(threading.current_thread) is second.call(threading.current_thread) is host.thread
    gate = threading.Event()

    async def held() -> str:  # on the loop, waiting for a thread (not blocking the loop)
        while not gate.is_set():
            await asyncio.sleep(0.01)
        return "done"

    waiting = first.submit(held())
    spawned = first.call(lambda: first.spawn(held()))
    first.stop(_nothing, grace=1)
    with pytest.raises((RuntimeError, concurrent.futures.CancelledError)):
        waiting.result(5)
    assert second.call(lambda: spawned.cancelled() or spawned.done())  # its own task is over
    with pytest.raises(RuntimeError, match="first node not started"):
        first.submit(_nothing())
    assert second.call(lambda: "still serving") == "still serving"
    second.stop(_nothing, grace=1)
    assert host.loop.is_running()  # (the host's own stop ends the loop)
    host.stop(_nothing, grace=1)
    assert not host.thread.is_alive()
    gate.set()

