"""LoopThread, the bridge between a caller's thread and a transport's event loop: what other threads
submitted when it stops is failed (no waiter is left hanging) and, if it never ran, closed (Python
never reports a coroutine that was never awaited)."""
from __future__ import annotations

import gc
import threading
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
