"""Faults a node schedules by its own steps: link bursts (`--link-burst SRC<->DST@STEP+STEPS:SPEC`, a
link spec for a window of steps, e.g. a block that relays route around) and slow windows (`--slow
RANK@STEP+STEPS:FACTOR`). Each node applies the entries that concern it at its step boundaries."""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

from p2ptrain import cli
from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.algorithms.dpsgd import DPSGD
from p2ptrain.node import Node
from p2ptrain.settings import ConfigError, NodeConfig
from p2ptrain.settings.parsers import LinkBurst, SlowSchedule, SlowWindow, StepWindow
from p2ptrain.topology.undirected import UndirectedRing
from p2ptrain.train import DecentralizedTrainer
from p2ptrain.transport import TransportOptions
from p2ptrain.transport.faults import EmulatedLinks, LinkSpec, LinkTable
from tests.cluster import run_cluster
from tests.conftest import ROOT, node_env
from tests.test_relay import forwarded
from tests.test_transport import nodes

torch.set_num_threads(1)

pytestmark = pytest.mark.timeout(60)

PEERS3 = "127.0.0.1:1,127.0.0.1:2,127.0.0.1:3"


# -- the entries ------------------------------------------------------------------------------------
def test_entries_parse_into_windows_links_and_factors():
    assert StepWindow.parse("100+20") == StepWindow(100, 20) and StepWindow(100, 20).end == 120
    assert 100 in StepWindow(100, 20) and 119 in StepWindow(100, 20)
    assert 99 not in StepWindow(100, 20) and 120 not in StepWindow(100, 20)
    burst = LinkBurst.parse("0<->2@100+20:drop=0.5,latency=5ms")
    assert burst == LinkBurst(0, 2, True, StepWindow(100, 20), "drop=0.5,latency=5ms")
    assert [(b.src, b.dst, b.both_ways) for b in burst.directed()] == [(0, 2, False), (2, 0, False)]
    assert LinkBurst.parse(" 3 -> 1 @7+1:block").directed() == [LinkBurst(3, 1, False, StepWindow(7, 1), "block")]
    assert SlowWindow.parse("1@50+30:4") == SlowWindow(1, StepWindow(50, 30), 4.0)
    schedule = SlowSchedule(2.0, (SlowWindow.parse("1@3+2:4"), SlowWindow.parse("1@4+2:3")))
    assert [schedule(s) for s in range(7)] == [2, 2, 2, 8, 24, 6, 2]  # on top of --slowdown, overlaps multiply


@pytest.mark.parametrize("parse, entry, message", [
    (LinkBurst.parse, "0<->2:block", r"link burst '0<->2:block' is not SRC->DST@STEP\+STEPS:SPEC"),
    (LinkBurst.parse, "0=>2@5+5:block", "is not SRC->DST@STEP"),
    (LinkBurst.parse, "0->2@5+5", "is not SRC->DST@STEP"),
    (LinkBurst.parse, "0->2@5+5:", r"link burst '0->2@5\+5:' has no SPEC"),
    (LinkBurst.parse, "1<->1@5+5:block", "a node has no link to itself"),
    (LinkBurst.parse, "0->2@5:block", r"link burst '0->2@5:block': '5' is not STEP\+STEPS"),
    (LinkBurst.parse, "0->2@5+0:block", "lasts no step: STEPS must be >= 1"),
    (LinkBurst.parse, "0->2@-5+3:block", "is not STEP"),
    (SlowWindow.parse, "1@50:4", r"slow window '1@50:4': '50' is not STEP\+STEPS"),
    (SlowWindow.parse, "1@50+30", r"slow window '1@50\+30' is not RANK@STEP\+STEPS:FACTOR"),
    (SlowWindow.parse, "x@50+30:4", "is not RANK@STEP"),
    (SlowWindow.parse, "1@50+30:fast", "FACTOR 'fast' is not a number"),
    (SlowWindow.parse, "1@50+30:0.5", "FACTOR must be >= 1"),
    (SlowWindow.parse, "1@50+30:inf", "FACTOR must be >= 1"),
])
def test_bad_entries_are_refused_in_one_line_naming_the_entry(parse, entry, message):
    with pytest.raises(ValueError, match=message) as caught:
        parse(entry)
    assert "\n" not in str(caught.value)


# -- the settings ---------------------------------------------------------------------------------
def test_flags_repeat_reach_the_config_and_launch_passes_them_on():
    argv = ["--world-size", "3", "--peers", PEERS3, "--link-override", "0->1:latency=10ms",
            "--link-burst", "0<->1@10+5:drop=0.5", "--link-burst", "2->0@20+3:block",
            "--slow", "1@5+10:4", "--slow", "2@8+2:3"]
    config = cli.config_from_args(cli.build_parser().parse_args(["node", *argv]))
    assert config.link_bursts == ["0<->1@10+5:drop=0.5", "2->0@20+3:block"]
    assert config.slow_windows == ["1@5+10:4", "2@8+2:3"]
    table = config.link_table()
    assert table.spec_at(0, 1, 9) == LinkSpec(latency=0.01)
    assert table.spec_at(0, 1, 10) == table.spec_at(0, 1, 14) == LinkSpec(latency=0.01, drop=0.5)  # on top
    assert table.spec_at(1, 0, 12) == LinkSpec(drop=0.5) and table.spec_at(0, 1, 15) == LinkSpec(latency=0.01)
    assert table.spec_at(2, 0, 22).blocked and not table.spec_at(0, 2, 22).blocked  # one direction
    assert config.slowdown_schedule == 1.0  # rank 0: no window, the plain factor
    assert config.replace(rank=1).slowdown_schedule(14) == 4.0
    launch = cli.build_parser().parse_args(["launch", "--nodes", "3", *argv[4:]])
    again = cli.build_parser().parse_args(["node", *argv[:4], *cli.node_flags_as_argv(launch)])
    config_again = cli.config_from_args(again)
    assert config_again.link_table() == table and config_again.slow_windows == config.slow_windows


def test_schedules_from_toml_and_env(tmp_path):
    path = tmp_path / "node.toml"
    path.write_text('[node]\nworld_size = 3\npeers = ["a:1", "b:2", "c:3"]\nslow_windows = ["2@5+5:3"]\n'
                    '[node.link_bursts]\n"0<->2@10+5" = "block"\n"1->0@3+1" = "drop=0.2,latency=1ms"\n')
    config = NodeConfig.from_sources(toml_path=path, env={})
    assert config.link_bursts == ["0<->2@10+5:block", "1->0@3+1:drop=0.2,latency=1ms"]
    assert config.link_table().spec_at(2, 0, 10).blocked
    env = {"P2PTRAIN_LINK_BURSTS": "0->1@1+2:drop=0.1,latency=2ms; 1->2@3+4:block",
           "P2PTRAIN_SLOW_WINDOWS": "0@1+2:2,1@3+4:5"}
    config = NodeConfig.from_sources(toml_path=path, env=env)
    assert config.link_bursts == ["0->1@1+2:drop=0.1,latency=2ms", "1->2@3+4:block"]
    assert config.slow_windows == ["0@1+2:2", "1@3+4:5"] and config.slowdown_schedule(1) == 2.0


@pytest.mark.parametrize("flags, message", [
    ({"link_bursts": "0<->5@10+5:block"}, r"link emulation: link burst 0->5@10\+5 names a rank outside 0\.\.2"),
    ({"link_bursts": "0<->1@10+5:drop=1.5"},
     r"link emulation: link burst '0<->1@10\+5:drop=1.5': drop probability must be in \[0, 1\)"),
    ({"link_bursts": "0<->1@10+5:speed=1"}, "link emulation: link burst .*unknown link spec key 'speed'"),
    ({"link_bursts": "0<->1@10:block"}, r"link emulation: link burst '0<->1@10:block': '10' is not STEP\+STEPS"),
    ({"slow_windows": "3@10+5:2"}, "compute slow-down: slow window of rank 3: rank outside 0..2"),
    ({"slow_windows": "1@10+5:0"}, "compute slow-down: slow window '1@10.5:0': FACTOR must be >= 1"),
])
def test_bad_schedules_raise_config_error(flags, message):
    with pytest.raises(ConfigError, match=message):
        NodeConfig.from_sources(env={}, flags={"world_size": 3, "peers": PEERS3, **flags})


def test_without_a_schedule_nothing_changes_on_the_send_path_or_in_the_step_loop():
    plain = NodeConfig(world_size=3, peers=PEERS3.split(","))
    assert plain.link_table() is None and plain.slowdown_schedule == 1.0
    assert NodeConfig(world_size=3, peers=PEERS3.split(","), slowdown="0=3").slowdown_schedule == 3.0
    node = Node(plain, device=torch.device("cpu"))  # not started: no sockets
    assert node.transport.links is None
    shaped = EmulatedLinks(LinkTable.parse("latency=1ms"), 0)
    assert not shaped.scheduled  # a table without bursts: the node adds no step listener
    scheduled = Node(plain.replace(link_bursts=["1->2@5+5:block"]), device=torch.device("cpu"))
    assert scheduled.transport.links is not None and not scheduled.transport.links.scheduled  # rank 0: not its link


# -- the links follow the steps ---------------------------------------------------------------------
def test_emulated_links_switch_exactly_at_the_window_boundaries():
    table = LinkTable.parse("latency=1ms", ["0->1:drop=0.1"], bursts=["0<->2@3+2:block", "0->1@4+3:drop=0.5",
                                                                       "1->2@0+9:block"])
    links = EmulatedLinks(table, 0)
    assert links.scheduled
    seen = []
    for step in [*range(9), 0]:  # ... and back to an earlier step (a node restarted into the window)
        links.at_step(step)
        seen.append((step, links.blocked(2), links.spec(1).drop))
    assert seen == [(0, False, 0.1), (1, False, 0.1), (2, False, 0.1), (3, True, 0.1), (4, True, 0.5),
                    (5, False, 0.5), (6, False, 0.5), (7, False, 0.1), (8, False, 0.1), (0, False, 0.1)]
    assert not links.blocked(1)  # node 1's burst on 1->2 is node 1's to apply


def test_a_burst_keeps_the_links_random_stream():
    """A drop burst swaps what the link does, not its RNG: the draws go on where they were, so a run
    repeats however its bursts fall."""
    import asyncio

    def drops(bursts) -> list[int]:
        links = EmulatedLinks(LinkTable.parse("drop=0.3", bursts=bursts, seed=4), 0)
        counted = []

        class Count:
            def on_dropped(self, peer):
                counted[-1] += 1

        links.metrics = Count()

        async def send(step):
            links.at_step(step)
            counted.append(0)
            await links.emulate(1, 10, reliable=True)  # retransmits until it arrives: every drop counted

        async def run():
            for step in range(40):
                await send(step)

        asyncio.run(run())
        return counted

    quiet, bursty = drops([]), drops(["0->1@10+10:drop=0.9"])
    assert quiet[:10] == bursty[:10] and bursty == drops(["0->1@10+10:drop=0.9"])  # reproducible
    assert sum(bursty[10:20]) > 3 * sum(quiet[10:20]) + 5, (quiet, bursty)


def test_a_block_burst_reroutes_through_a_relay_on_real_transports():
    """Node 0 sends to node 2 once per step; 0<->2 is blocked for steps 2..4: exactly those messages
    go through node 1 (it counts them as forwarded), the others go direct."""
    table = LinkTable.parse(None, bursts=["0<->2@2+3:block"])
    options = TransportOptions(shutdown_grace=0.2, send_timeout=20.0, links=table, relay_retry_after=0.05)
    with nodes(3, options=options) as t:
        t[2].expect(pb.MESSAGE_KIND_PUSH_SUM, torch.float32, 100)
        t[0].membership.wait_for_peers(timeout=10)
        relayed = []
        for step in range(7):
            t[0].links.at_step(step)
            t[2].links.at_step(step)
            time.sleep(0.1)  # past relay_retry_after: a healed link is tried direct again
            before = forwarded(t[1])
            tensor = torch.full((100,), float(step))
            ack = t[0].sender.send(2, tensor, kind=pb.MESSAGE_KIND_PUSH_SUM, step=step).result(30)
            assert ack.status == pb.Ack.STATUS_ACCEPTED, ack
            assert torch.equal(t[2].recv(pb.MESSAGE_KIND_PUSH_SUM, step, [0], timeout=10)[0].tensor, tensor)
            relayed.append(forwarded(t[1]) - before)
        assert relayed == [0, 0, 1, 1, 1, 0, 0]


# -- slow windows ------------------------------------------------------------------------------------
def test_the_trainer_stretches_only_the_steps_of_a_slow_window():
    """Rank 0 of two D-PSGD nodes is 200x slower for steps 10..14 only: those steps take far longer
    than its others (the factor stretches its compute, as --slowdown does)."""
    schedule = SlowSchedule(1.0, (SlowWindow.parse("0@10+5:200"),))

    def body(rank, comm):
        model = nn.Linear(64, 8)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        trainer = DecentralizedTrainer(model, optimizer, DPSGD(comm, UndirectedRing(2)), comm=comm,
                                       loss_fn=lambda out, target: out.pow(2).mean(),
                                       slowdown=schedule if rank == 0 else 1.0)
        batches = iter(lambda: (torch.randn(32, 64), torch.zeros(32)), None)
        return trainer.fit(batches, 25).step_seconds

    seconds = run_cluster(2, body, options=TransportOptions(send_timeout=30.0))[0]
    window, outside = seconds[10:15], seconds[2:10] + seconds[16:]
    assert min(window) > 4 * statistics.median(outside), (window, outside)


# -- a real launch ----------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_launch_blocks_a_link_and_slows_a_node_for_their_windows_only(tmp_path):
    """3 SGP processes on the exponential graph, which puts exactly one message per step on the pair
    0<->2: blocked for steps 60..99, those 40 go through node 1 (and, until the short relay retry
    is over, a few more), not the 100 that follow; node 1, 20x slower for steps 130..159, takes
    much longer for those steps than for the others. The launcher logs both where they start."""
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "p2ptrain", "launch", "--nodes", "3", "--out", str(out), "--no-live",
            "--no-metrics", "--timeout", "240", "--algorithm", "sgp", "--topology", "exponential", "--steps", "200",
            "--num-train", "3000", "--log-every", "1", "--relay-retry-after", "0.2",
            "--link-burst", "0<->2@60+40:block", "--slow", "1@130+30:20"]
    proc = subprocess.run(argv, cwd=ROOT, env=node_env(), capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, f"launch failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "fault: link node 0 <-> node 2: block for 40 steps" in proc.stderr
    link, slow = [json.loads(line) for line in (out / "faults.jsonl").read_text().splitlines()]
    assert {k: link[k] for k in ("action", "rank", "peer", "both_ways", "spec", "steps", "planned_step")} == \
        {"action": "link", "rank": 0, "peer": 2, "both_ways": True, "spec": "block", "steps": 40, "planned_step": 60}
    assert (slow["action"], slow["rank"], slow["spec"], slow["steps"]) == ("slow", 1, "20", 30)
    assert link["cluster_step"] >= link["planned_step"] and slow["cluster_step"] >= slow["planned_step"] == 130
    summaries = {s["rank"]: s for s in json.loads((out / "report.json").read_text())["nodes"]}
    relayed = summaries[1]["forwarded_messages"]
    print(f"node 1 forwarded {relayed} messages of the 0<->2 pair")
    assert 40 <= relayed < 90, relayed
    assert summaries[0]["forwarded_messages"] == summaries[2]["forwarded_messages"] == 0
    seconds = {line["step"]: line["step_seconds"] for line in map(json.loads, (out / "node1.progress.jsonl").open())
               if "step_seconds" in line}  # line step s: steps done, so step s - 1 just ran
    window = statistics.median(seconds[s] for s in range(131, 161))
    outside = statistics.median([seconds[s] for s in [*range(21, 56), *range(171, 201)]])
    print(f"node 1: median step {window * 1e3:.1f} ms in its slow window, {outside * 1e3:.1f} ms outside")
    assert window > 2 * outside, (window, outside)
