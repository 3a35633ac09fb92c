"""`launch --chaos`: a seeded plan of random faults that the launcher's own fault validation and the
nodes' settings accept, that always keeps two members running and, while a link is blocked, a
route between every pair."""
from __future__ import annotations

import pytest

from launcher.chaos import KINDS, chaos_plan, parse_kinds
from launcher.local import FaultEvent, fault_plan
from p2ptrain.settings import NodeConfig
from p2ptrain.settings.parsers import LinkBurst, SlowWindow


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("nodes", [4, 6])
def test_a_chaos_plan_is_reproducible_valid_and_keeps_two_members_running(seed, nodes):
    steps, count = 600, 40
    plan = chaos_plan(nodes, steps, count, seed=seed, max_stall=12)
    assert plan == chaos_plan(nodes, steps, count, seed=seed, max_stall=12)
    assert 0 < plan.events <= count
    events = fault_plan(plan.kills, plan.restarts, nodes, plan.stalls, plan.joins, plan.leaves,  # raises if invalid
                        plan.link_bursts, plan.slows)
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
        assert len(members) >= nodes // 2 + 1, "leaves withered the cluster"
    assert not down, "a killed node was never restarted"
    assert all(e.at_step + e.steps <= 510 for e in events if e.action in ("link", "slow"))  # the end stays quiet


def up_members(events: list[FaultEvent], nodes: int, step: int) -> set[int]:
    """Members not killed just after the process faults of steps up to `step` (a joiner counts from its step)."""
    members, down = set(range(nodes)), set()
    for event in events:
        if event.at_step > step:
            break
        if event.action == "join":
            members.add(event.rank)
        elif event.action == "leave":
            members.discard(event.rank)
        elif event.action == "kill":
            down.add(event.rank)
        elif event.action == "restart":
            down.discard(event.rank)
    return members - down


@pytest.mark.parametrize("nodes", [2, 3, 5])
def test_link_bursts_and_slow_windows_keep_their_ranges_and_every_pair_a_route(nodes):
    """Over many seeds: drop bursts lose 30-90% for 5-30 steps, blocks last 5-50 steps, one at a time,
    and while one is in force 3 members stay up (a relay for the pair); slow
    windows are 2-6x for 10-100 steps, never two at once on a node; the nodes' settings take the plan.
    With 2 nodes a block needs a joined third one."""
    steps, blocks = 1000, 0
    for seed in range(60):
        plan = chaos_plan(nodes, steps, 60, seed=seed, max_stall=5)
        assert plan == chaos_plan(nodes, steps, 60, seed=seed, max_stall=5)
        events = fault_plan(plan.kills, plan.restarts, nodes, plan.stalls, plan.joins, plan.leaves,
                            plan.link_bursts, plan.slows)
        bursts = [LinkBurst.parse(entry) for entry in plan.link_bursts]
        blocked = [b for b in bursts if b.spec == "block"]
        for burst in bursts:
            assert 100 <= burst.window.start and burst.window.end <= 850, burst
            cut = burst.window.end == 850  # (a window is cut short at the quiet end)
            if burst.spec == "block":
                assert burst.both_ways and (5 <= burst.window.steps <= 50 or cut), burst
            else:
                assert burst.spec.startswith("drop=") and 0.3 <= float(burst.spec[5:]) <= 0.9, burst
                assert 5 <= burst.window.steps <= 30 or cut, burst
        for one, other in zip(blocked, blocked[1:]):
            assert one.window.end <= other.window.start, (one, other)  # one block at a time
        for block in blocked:
            for step in range(block.window.start, block.window.end):
                assert len(up_members(events, nodes, step)) >= 3, (seed, block, step)
        windows = [SlowWindow.parse(entry) for entry in plan.slows]
        for window in windows:
            assert 2.0 <= window.factor <= 6.0 and (10 <= window.window.steps <= 100 or window.window.end == 850)
        for rank in {w.rank for w in windows}:
            mine = sorted((w.window for w in windows if w.rank == rank))
            assert all(a.end <= b.start for a, b in zip(mine, mine[1:])), mine
        blocks += len(blocked)
        slots = nodes + len(plan.joins)
        config = NodeConfig.from_sources(env={}, flags={
            "world_size": nodes, "max_nodes": slots if plan.joins else None,
            "peers": [f"127.0.0.1:{port}" for port in range(1, slots + 1)],
            "link_bursts": ";".join(plan.link_bursts), "slow_windows": ",".join(plan.slows)})  # raises if invalid
        assert len(config.link_table().bursts) >= len(plan.link_bursts)
    assert blocks > 0


def test_the_launcher_logs_link_bursts_and_slow_windows_with_their_spec_pair_and_steps():
    link = FaultEvent.scheduled("link", "2<->0@120+15:drop=0.5", 3)
    assert (link.action, link.rank, link.peer, link.both_ways, link.at_step, link.steps, link.spec) == \
        ("link", 2, 0, True, 120, 15, "drop=0.5")
    assert link.window == {"peer": 0, "both_ways": True, "spec": "drop=0.5", "steps": 15}
    assert link.what == " <-> node 0: drop=0.5 for 15 steps"
    slow = FaultEvent.scheduled("slow", "1@50+30:4", 3)
    assert (slow.rank, slow.at_step, slow.window) == (1, 50, {"spec": "4", "steps": 30})
    assert FaultEvent("kill", 1, 5).window == {} and FaultEvent("kill", 1, 5).what == ""
    events = fault_plan(["1@60"], [], 3, link_bursts=["0->1@50+20:block"], slows=["1@55+10:3"])
    assert [(e.action, e.at_step) for e in events] == [("link", 50), ("slow", 55), ("kill", 60)]  # on a killed node too
    with pytest.raises(ValueError, match=r"--link-burst '0<->3@5\+5:block': a rank outside 0\.\.2"):
        fault_plan([], [], 3, link_bursts=["0<->3@5+5:block"])
    with pytest.raises(ValueError, match="--slow: slow window '1@5:2': '5' is not STEP"):
        fault_plan([], [], 3, slows=["1@5:2"])


def test_chaos_plans_differ_by_seed_and_draw_only_the_kinds_asked_for():
    plans = [chaos_plan(6, 1000, 30, seed=s, kinds=("kill", "stall")) for s in range(3)]
    assert plans[0] != plans[1] != plans[2]
    assert all(not p.leaves and not p.joins and p.kills and p.stalls and not p.link_bursts and not p.slows
               for p in plans)
    plans = [chaos_plan(2, 1000, 30, seed=s, kinds=("link", "slow")) for s in range(3)]
    assert all(p.link_bursts and p.slows and not (p.kills or p.stalls or p.leaves or p.joins) for p in plans)
    assert all("block" not in entry for p in plans for entry in p.link_bursts)  # 2 nodes: a block cuts them off
    assert plans[0].events == len(plans[0].link_bursts) + len(plans[0].slows) == 30


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
