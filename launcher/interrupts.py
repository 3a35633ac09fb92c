"""Ctrl-C stops a launch even when the launcher was started with SIGINT ignored.

A non-interactive shell starts `cmd &` with SIGINT set to SIG_IGN, and Python keeps an inherited
SIG_IGN (it installs its KeyboardInterrupt handler only over SIG_DFL). The launcher's cleanup (stop
every node, remove the namespaces, write the report) runs on KeyboardInterrupt, so a SIGINT sent
to such a launcher (by a supervisor, CI's timeout, `kill -INT`) would be lost and the run would go
on. While a launch runs, SIGINT raises KeyboardInterrupt again; the earlier disposition comes back
afterwards. It never touches a handler someone else installed, and does nothing off the main thread
(only the main thread may set handlers).
"""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator


@contextlib.contextmanager
def sigint_interrupts() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt inside the block, also where it was ignored."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        yield
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


__all__ = ["sigint_interrupts"]
