"""Hang-ups: a peer whose lane connections to this node all closed may be gone; a wait for it asks.

A process that dies (SIGKILL, a crash) has its sockets closed by its kernel at once, so the lane
connections it sent on end within milliseconds, long before a link deadline. A closed connection
proves nothing by itself (a sender retires idle connections, a restarting peer reconnects), so it
is a hint: while (or once) this node waits for that peer's message, it asks once whether anything
still listens at the peer's address (Greetings.check_gone). Only a refused connect, a definitive
answer, declares the peer dead, which ends every wait for it at once; an answer, silence or a peer
reached through relays leaves the wait to its link deadline. A new connection withdraws the hint.
"""
from __future__ import annotations

from typing import Awaitable, Callable, Iterable

from p2ptrain.transport.loop_thread import LoopThread


class Hangups:
    """Node-wide, on the loop thread. `awaited()`: the senders some wait is for now (Inbox.awaited);
    `check(peer)`: declare `peer` dead if a connect to it is refused (Greetings.check_gone)."""

    def __init__(self, loop: LoopThread, awaited: Callable[[], set[int]],
                 check: Callable[[int], Awaitable[None]]):
        self.loop = loop
        self.awaited = awaited
        self.check = check
        self._pending: set[int] = set()  # peers that hung up, not asked about since

    def hung_up(self, peer: int) -> None:
        """The last lane connection from `peer` closed: ask now if a wait is for it, else at the next."""
        self._pending.add(peer)
        if peer in self.awaited():
            self._ask(peer)

    def reconnected(self, peer: int) -> None:
        """`peer` opened a lane connection again: it is there."""
        self._pending.discard(peer)

    def waiting(self, peers: Iterable[int]) -> None:
        """A wait for `peers`' messages begins: ask about those that hung up."""
        for peer in [p for p in peers if p in self._pending]:
            self._ask(peer)

    def _ask(self, peer: int) -> None:
        self._pending.discard(peer)  # once per hang-up: a peer that still listens is waited for as usual
        self.loop.spawn(self.check(peer))


__all__ = ["Hangups"]
