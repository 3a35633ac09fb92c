"""`launch --chaos`: a seeded plan of random faults that the launcher's own fault validation accepts
and that always keeps two members running."""
from __future__ import annotations

import pytest

from launcher.chaos import KINDS, chaos_plan, parse_kinds
from launcher.local import fault_plan


@pytest.mark.parametrize("seed", range(20))
def test_a_chaos_plan_is_reproducible_valid_and_keeps_two_members_running(seed):
    nodes, steps, count = 4, 600, 40
    plan = chaos_plan(nodes, steps, count, seed=seed, max_stall=12)
    assert plan == chaos_plan(nodes, steps, count, seed=seed, max_stall=12)
    assert 0 < plan.events <= count
    events = fault_plan(plan.kills, plan.restarts, nodes, plan.stalls, plan.joins, plan.leaves)  # raises if invalid
    assert all(60 <= e.at_step <= 510 for e in events)
    assert len(plan.joins) <= nodes // 2 and all(e.at_step < 360 for e in events if e.action == "join")
    assert all(1.0 <= e.seconds <= 12 for e in events if e.action == "stall")
    members, down = set(range(nodes)), set()
    for event in events:  # (kills before restarts of the same step: fault_plan's order)
        if event.action == "join":
            members.add(event.rank)
        elif event.action == "leave":
            members.discard(event.rank)
        elif event.action == "kill":
            down.add(event.rank)
        elif event.action == "restart":
            down.discard(event.rank)
        assert len(members - down) >= 2, (event, members, down)
    assert not down, "a killed node was never restarted"


def test_chaos_plans_differ_by_seed_and_draw_only_the_kinds_asked_for():
    plans = [chaos_plan(6, 1000, 30, seed=s, kinds=("kill", "stall")) for s in range(3)]
    assert plans[0] != plans[1] != plans[2]
    assert all(not p.leaves and not p.joins and p.kills and p.stalls for p in plans)


def test_bad_chaos_settings_are_refused_in_one_line():
    with pytest.raises(ValueError, match="choose from"):
        parse_kinds("kill,crash")
    assert parse_kinds(" kill , stall ") == ("kill", "stall") and set(parse_kinds(",".join(KINDS))) == set(KINDS)
    with pytest.raises(ValueError, match="at least 2 nodes"):
        chaos_plan(1, 100, 3)
    with pytest.raises(ValueError, match="faults fit a run"):
        chaos_plan(4, 20, 50)
    with pytest.raises(ValueError, match="max-stall"):
        chaos_plan(4, 100, 3, max_stall=0.5)
