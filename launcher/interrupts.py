"""Ctrl-C, or SIGTERM, stops a launch and cleans up, also where the launcher was started with SIGINT ignored.

A non-interactive shell starts `cmd &` with SIGINT set to SIG_IGN, and Python keeps an inherited
SIG_IGN (it installs its KeyboardInterrupt handler only over SIG_DFL). The launcher's cleanup (stop
every node, remove the namespaces, write the report) runs on KeyboardInterrupt, so a SIGINT sent
to such a launcher (by a supervisor, CI's timeout, `kill -INT`) would be lost and the run would go
on; a SIGTERM (`timeout`, `kill`, a scheduler) would kill the launcher alone and leave its nodes,
which run in sessions of their own, behind. While a launch runs, both raise KeyboardInterrupt
(SIGTERM as its subclass Terminated); the earlier dispositions come back afterwards. It never
touches a handler someone else installed, and does nothing off the main thread.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator


class Terminated(KeyboardInterrupt):
    """SIGTERM during a launch: the same cleanup as Ctrl-C."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated("SIGTERM")


@contextlib.contextmanager
def sigint_interrupts() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt inside the block, also where it was ignored; SIGTERM
    (where nobody handles it) raises Terminated."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    replaced = {}
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        replaced[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        replaced[signal.SIGTERM] = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        for signum, previous in replaced.items():
            signal.signal(signum, previous)


__all__ = ["Terminated", "sigint_interrupts"]
