"""Placement: the order in which rings and graphs lay the members out, so that peers that cannot dial
each other are rarely neighbours.

Two private nodes behind different NATs reach each other only through a relay, whose capped upload
then carries the message twice. A ring over ranks in their own order puts such nodes next to each
other whenever their ranks are; here each group of private nodes that share a NAT (they reach one
another on their own LAN) is laid out together, and the groups are kept apart by public nodes,
spread as evenly as there are public nodes. Pure function of what the proposer saw: the order
travels in the view (views.py), so every node lays the members out the same way.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping


def place(members: Iterable[int], nat_of: Mapping[int, str]) -> tuple[int, ...]:
    """The members in ring order: the private ones (`nat_of`: member -> the host its NAT shows;
    members absent are public) in groups by that host, each group followed by its share of the
    public ones. Rank order when at most one group is private (nothing to keep apart)."""
    members = sorted(set(members))
    groups: dict[str, list[int]] = {}
    for member in members:
        if member in nat_of:
            groups.setdefault(nat_of[member], []).append(member)
    if len(groups) < 2:
        return tuple(members)
    public = [m for m in members if m not in nat_of]
    order: list[int] = []
    ordered = sorted(groups.values(), key=min)
    for i, group in enumerate(ordered):  # group i is followed by public[start:end], shares differing by one at most
        start, end = (len(public) * i) // len(ordered), (len(public) * (i + 1)) // len(ordered)
        order += group + public[start:end]
    return tuple(order)


def neighbours_apart(order: tuple[int, ...], nat_of: Mapping[int, str]) -> int:
    """How many ring neighbours in `order` are private behind different NATs (relayed hops)."""
    pairs = zip(order, order[1:] + order[:1]) if len(order) > 2 else zip(order[:1], order[1:])
    return sum(1 for a, b in pairs if a in nat_of and b in nat_of and nat_of[a] != nat_of[b])


__all__ = ["neighbours_apart", "place"]
