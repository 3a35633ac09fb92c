"""Link emulation (p2ptrain/transport/faults.py): spec parsing, and its effect on real Transports on
loopback: bandwidth caps, latency and jitter, drops, reliable sends, and the node settings."""
from __future__ import annotations

import asyncio
import concurrent.futures
import math
import random
import time
from contextlib import ExitStack, contextmanager

import pytest
import torch

from launcher.ports import free_ports
from p2ptrain import cli
from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.metrics import NodeMetrics
from p2ptrain.node import Node
from p2ptrain.settings import ConfigError, NodeConfig
from p2ptrain.transport import Transport, TransportOptions
from p2ptrain.transport.faults import (
    DEFAULT_BURST_BYTES,
    LinkEmulator,
    LinkSpec,
    LinkTable,
    MessageDropped,
    parse_bandwidth,
    parse_duration,
)
from tests.test_transport import PLANES

torch.set_num_threads(1)

pytestmark = pytest.mark.timeout(60)

KIND = pb.MESSAGE_KIND_PUSH_SUM
PEERS2 = "127.0.0.1:50051,127.0.0.1:50052"


# -- parsing ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, bytes_per_s", [
    ("200mbit", 25e6), ("1gbit", 125e6), ("500kbit", 62.5e3), ("800bit", 100), ("1Gbit", 125e6),
    ("25MB/s", 25e6), ("512KB/s", 512e3), ("1kB/s", 1e3), ("2GB/s", 2e9), ("3B/s", 3),
    ("1MiB/s", 1 << 20), ("4KiB/s", 4096), ("1GiB/s", 1 << 30), ("1000", 1000), (" 2.5e3 ", 2500),
])
def test_parse_bandwidth_units(text, bytes_per_s):
    assert parse_bandwidth(text) == pytest.approx(bytes_per_s)


@pytest.mark.parametrize("text, message", [
    ("", "not a number"), ("fast", "not a number"), ("-1mbit", "negative"), ("0", "must be > 0"),
    ("10mbps", "unknown bandwidth unit 'mbps'"), ("10mb/s", "unknown bandwidth unit"), ("nan", "not a number"),
])
def test_parse_bandwidth_errors(text, message):
    with pytest.raises(ValueError, match=message):
        parse_bandwidth(text)


@pytest.mark.parametrize("text, seconds", [("5ms", 0.005), ("0.5s", 0.5), ("200us", 200e-6), ("2", 2.0),
                                           ("0", 0.0), ("1.5 ms", 0.0015)])
def test_parse_duration_units(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text, message", [("", "not a number"), ("-5ms", "negative"),
                                           ("5m", "unknown duration unit 'm'"), ("ms", "not a number")])
def test_parse_duration_errors(text, message):
    with pytest.raises(ValueError, match=message):
        parse_duration(text)


def test_link_spec_parse_and_noop():
    spec = LinkSpec.parse("bandwidth=200mbit, latency=5ms,jitter=1ms,drop=0.01")
    assert spec == LinkSpec(bandwidth=25e6, latency=0.005, jitter=0.001, drop=0.01)
    assert not spec.is_noop and LinkSpec().is_noop and LinkSpec.parse("").is_noop
    assert LinkSpec.parse("drop=2.5%").drop == pytest.approx(0.025)
    assert LinkSpec.parse("latency=1ms", base=spec) == LinkSpec(25e6, 0.001, 0.001, 0.01)
    assert LinkSpec.parse("bandwidth=unlimited", base=spec).bandwidth is None
    assert LinkSpec.parse(str(spec)) == spec  # str() is a spec again


@pytest.mark.parametrize("text, message", [
    ("latency", "not key=value"), ("speed=1mbit", "unknown link spec key 'speed'"),
    ("drop=1", r"drop probability must be in \[0, 1\)"), ("drop=0.5x", "drop probability"),
    ("latency=1ms,latency=2ms", "sets latency twice"), ("jitter=-1ms", "negative"),
    ("bandwidth=0", "must be > 0"),
])
def test_link_spec_errors(text, message):
    with pytest.raises(ValueError, match=message):
        LinkSpec.parse(text)


def test_link_table_overrides_apply_in_order_on_top_of_the_default():
    table = LinkTable.parse("bandwidth=200mbit,latency=5ms",
                            ["0->1:latency=50ms", "1<->2:drop=0.1", "2->1:bandwidth=unlimited"])
    default = LinkSpec(25e6, 0.005)
    assert table.spec_for(1, 0) == default and table.spec_for(0, 2) == default
    assert table.spec_for(0, 1) == LinkSpec(25e6, 0.05)  # keeps the default cap
    assert table.spec_for(1, 2) == LinkSpec(25e6, 0.005, drop=0.1)
    assert table.spec_for(2, 1) == LinkSpec(None, 0.005, drop=0.1)  # on top of the earlier 1<->2
    assert LinkTable.parse(None, {"0->1": "latency=50ms"}).spec_for(0, 1) == LinkSpec(latency=0.05)
    assert LinkTable.parse(None, ["0->1:"]).is_noop and LinkTable().is_noop
    assert not LinkTable.parse(None, ["0->1:drop=0.1"]).is_noop
    assert table.emulator(0, 1) is not None and LinkTable().emulator(0, 1) is None


@pytest.mark.parametrize("entry, message", [
    ("0-1:latency=5ms", "not SRC->DST:SPEC"), ("0->1", "not SRC->DST:SPEC"), ("a->1:drop=0.1", "not SRC->DST"),
    ("1->1:latency=5ms", "no link to itself"), ("0->1:latency=5x", "unknown duration unit 'x'"),
])
def test_link_table_entry_errors(entry, message):
    with pytest.raises(ValueError, match=message):
        LinkTable.parse(None, [entry])


def test_emulator_rng_is_seeded_per_link():
    def draws(table, src, dst):
        return [table.emulator(src, dst).rng.random() for _ in range(3)]

    table = LinkTable.parse("drop=0.1")
    assert draws(table, 0, 1) == draws(LinkTable.parse("drop=0.1"), 0, 1)  # reproducible
    assert draws(table, 0, 1) != draws(table, 1, 0)
    assert draws(table, 0, 1) != draws(LinkTable.parse("drop=0.1", seed=1), 0, 1)


# -- on real transports ------------------------------------------------------------------------------
@contextmanager
def pair(links: LinkTable | None, numel: int, plane: str = "auto"):
    """Node 0 (sending through `links`) and node 1 (accepting `numel` float32 per message, any channel),
    on data plane `plane` (the emulated link applies to the TCP lane as to gRPC streaming)."""
    peers = [f"127.0.0.1:{port}" for port in free_ports(2)]
    with ExitStack() as stack:
        started = []
        for rank in range(2):
            options = TransportOptions(shutdown_grace=0.2, send_timeout=20.0, links=links if rank == 0 else None,
                                       data_plane=plane)
            transport = Transport(rank, 2, peers, listen=peers[rank], options=options,
                                  metrics=NodeMetrics(rank, "test"))
            transport.start()
            stack.callback(transport.stop)
            started.append(transport)
        started[1].expect(KIND, torch.float32, numel)
        started[0].membership.wait_for_peers(10)  # channel up: the timings below measure the link only
        yield started


def send_all(sender: Transport, count: int, numel: int, **kwargs) -> tuple[list, list[float], float]:
    """`count` concurrent sends (channel per message); returns futures, completion times since start, total."""
    done_at = [math.nan] * count
    start = time.monotonic()
    futures = []
    for i in range(count):
        future = sender.sender.send(1, torch.full((numel,), float(i)), kind=KIND, step=0, channel=f"m{i}", **kwargs)
        future.add_done_callback(lambda _, i=i: done_at.__setitem__(i, time.monotonic() - start))
        futures.append(future)
    for future in futures:
        future.exception(30)
    return futures, done_at, time.monotonic() - start


def lane_messages(transport: Transport) -> float:
    return transport.metrics.registry.get_sample_value("p2ptrain_lane_messages_total",
                                                       {"node": "0", "peer": "1"}) or 0.0


def received(transport: Transport) -> float:
    return transport.metrics.registry.get_sample_value("p2ptrain_received_messages_total",
                                                       {"node": "1", "peer": "0"}) or 0.0


def dropped(transport: Transport) -> float:
    return transport.metrics.registry.get_sample_value("p2ptrain_dropped_messages_total",
                                                       {"node": "0", "peer": "1"}) or 0.0


def test_noop_table_leaves_the_send_path_alone():
    transport = Transport(0, 2, ["127.0.0.1:1", "127.0.0.1:2"], options=TransportOptions(links=LinkTable()))
    assert transport.links is None


@pytest.mark.parametrize("plane", PLANES)
def test_capped_link_moves_n_bytes_in_about_n_over_bandwidth(plane):
    numel, count, bandwidth = 31_250, 8, 1e6  # 8 x 125 kB = 1 MB at 1 MB/s: 1 s
    expected = count * numel * 4 / bandwidth
    with pair(LinkTable.parse("bandwidth=1MB/s"), numel, plane) as (t0, t1):
        futures, done_at, elapsed = send_all(t0, count, numel)
        assert all(f.result().status == pb.Ack.STATUS_ACCEPTED for f in futures)
        assert 0.5 * expected <= elapsed <= 2 * expected, elapsed
        assert done_at == sorted(done_at)  # FIFO through the bucket
        assert received(t1) == count
        assert lane_messages(t0) == (count if plane == "tcp" else 0)
    with pair(None, numel, plane) as (t0, _):
        _, _, uncapped = send_all(t0, count, numel)
    assert uncapped < expected / 3, uncapped  # loopback: tens of ms, more on a loaded machine


def test_token_bucket_lets_a_burst_through_then_paces():
    emulator = LinkEmulator(LinkSpec(bandwidth=40e3), random.Random(0))  # 64 KiB burst at 40 kB/s

    async def durations() -> list[float]:
        loop = asyncio.get_running_loop()
        out = []
        for nbytes in (4000, DEFAULT_BURST_BYTES):
            start = loop.time()
            await emulator.transmit(nbytes)
            out.append(loop.time() - start)
        return out

    small, big = asyncio.run(durations())
    assert small < 0.05, small  # within the burst: no wait (0.1 s without a bucket)
    assert 0.09 <= big <= 0.3, big  # the bucket is short by the first 4000 bytes: 0.1 s


@pytest.mark.parametrize("plane", PLANES)
def test_latency_delays_but_does_not_serialize_messages(plane):
    with pair(LinkTable.parse("latency=200ms"), 16, plane) as (t0, _):
        _, _, one = send_all(t0, 1, 16)
        assert one >= 0.19, one
        _, done_at, ten = send_all(t0, 10, 16)
    assert min(done_at) >= 0.19, done_at
    assert ten < 1.0, ten  # serialized, they would take 10 x 200 ms


def test_jitter_stays_within_latency_plus_minus_jitter():
    spec = LinkSpec(latency=0.06, jitter=0.03)
    draws = random.Random(5)
    expected = [spec.latency + draws.uniform(-spec.jitter, spec.jitter) for _ in range(30)]
    assert all(0.03 <= e <= 0.09 for e in expected) and max(expected) - min(expected) > 0.03
    emulator = LinkEmulator(spec, random.Random(5))

    async def delays() -> list[float]:
        loop = asyncio.get_running_loop()
        start = loop.time()

        async def one() -> float:
            await emulator.transmit(100)
            return loop.time() - start

        return await asyncio.gather(*(one() for _ in range(30)))  # concurrent: draws in call order

    measured = asyncio.run(delays())
    assert all(e - 0.002 <= m <= e + 0.1 for e, m in zip(expected, measured)), list(zip(expected, measured))
    with pair(LinkTable.parse("latency=60ms,jitter=30ms"), 16) as (t0, _):  # and end to end
        _, done_at, _ = send_all(t0, 10, 16)
    assert min(done_at) >= 0.029, done_at


@pytest.mark.parametrize("plane", PLANES)
def test_drop_probability_is_respected_and_counted(plane):
    count, p = 400, 0.25
    with pair(LinkTable.parse("drop=0.25"), 4, plane) as (t0, t1):
        futures, _, _ = send_all(t0, count, 4)
        failures = sum(isinstance(f.exception(), MessageDropped) for f in futures)
        assert all(f.exception() is None or isinstance(f.exception(), MessageDropped) for f in futures)
        sigma = math.sqrt(count * p * (1 - p))
        assert abs(failures - count * p) <= 5 * sigma, failures
        assert dropped(t0) == failures
        assert received(t1) == count - failures
        assert t1.inbox.pending() == count - failures


@pytest.mark.parametrize("plane", PLANES)
def test_reliable_sends_arrive_exactly_once_despite_drops(plane):
    count = 100
    with pair(LinkTable.parse("drop=0.5"), 4, plane) as (t0, t1):
        futures, _, _ = send_all(t0, count, 4, reliable=True)
        assert all(f.result().status == pb.Ack.STATUS_ACCEPTED for f in futures)
        assert received(t1) == count
        assert lane_messages(t0) == (count if plane == "tcp" else 0)
        messages = t1.take(KIND, 0, "m7")
        assert len(messages) == 1 and messages[0].tensor.tolist() == [7.0] * 4
        assert dropped(t0) > 20  # about one lost attempt per message at drop=0.5


def test_stop_cancels_sends_waiting_on_the_link():
    with pair(LinkTable.parse("latency=30s"), 4) as (t0, _):
        future = t0.sender.send(1, torch.zeros(4), kind=KIND, step=0)
        time.sleep(0.1)
        started = time.monotonic()
        t0.stop()
        with pytest.raises(concurrent.futures.CancelledError):
            future.result(5)
        assert time.monotonic() - started < 5


def test_dropped_message_pays_for_the_link_and_fails_late():
    """A lost message occupied the link and is noticed when it would have arrived."""
    emulator = LinkEmulator(LinkSpec(bandwidth=1e6, latency=0.05, drop=0.5), random.Random(3), burst=0)

    async def run() -> list[tuple[bool, float]]:
        outcomes = []
        for _ in range(6):
            start = asyncio.get_running_loop().time()
            try:
                await emulator.transmit(20_000)  # 20 ms on the link
                outcomes.append((True, asyncio.get_running_loop().time() - start))
            except MessageDropped:
                outcomes.append((False, asyncio.get_running_loop().time() - start))
        return outcomes

    outcomes = asyncio.run(run())
    assert {ok for ok, _ in outcomes} == {True, False}
    assert all(seconds >= 0.065 for _, seconds in outcomes), outcomes


# -- settings ----------------------------------------------------------------------------------------
def test_link_flags_reach_the_config_and_launch_passes_them_on():
    argv = ["--world-size", "2", "--peers", PEERS2, "--link", "bandwidth=200mbit,latency=5ms",
            "--link-override", "0->1:latency=50ms", "--link-override", "1<->0:drop=0.1"]
    args = cli.build_parser().parse_args(["node", *argv])
    config = cli.config_from_args(args)
    assert config.link == "bandwidth=200mbit,latency=5ms"
    assert config.link_overrides == ["0->1:latency=50ms", "1<->0:drop=0.1"]
    table = config.link_table()
    assert table.spec_for(0, 1) == LinkSpec(25e6, 0.05, drop=0.1)
    assert table.spec_for(1, 0) == LinkSpec(25e6, 0.005, drop=0.1)
    # launch re-emits its node flags for every node process; the repeated flag survives the trip
    launch = cli.build_parser().parse_args(["launch", "--nodes", "2", *argv[4:]])
    again = cli.build_parser().parse_args(["node", *argv[:4], *cli.node_flags_as_argv(launch)])
    assert cli.config_from_args(again).link_table() == table


def test_link_settings_from_toml_and_env(tmp_path):
    path = tmp_path / "node.toml"
    path.write_text('[node]\nworld_size = 3\npeers = ["a:1", "b:2", "c:3"]\nlink = "latency=5ms"\n'
                    '[node.link_overrides]\n"0->1" = "latency=50ms"\n"2<->1" = "drop=0.01"\n')
    config = NodeConfig.from_sources(toml_path=path, env={})
    assert config.link_overrides == ["0->1:latency=50ms", "2<->1:drop=0.01"]
    assert config.link_table().spec_for(1, 2) == LinkSpec(latency=0.005, drop=0.01)
    path.write_text('world_size = 2\npeers = ["a:1", "b:2"]\nlink_overrides = ["0->1:latency=50ms"]\n')
    assert NodeConfig.from_sources(toml_path=path, env={}).link_overrides == ["0->1:latency=50ms"]
    env = {"WORLD_SIZE": "2", "P2PTRAIN_PEERS": PEERS2, "P2PTRAIN_LINK": "bandwidth=1gbit",
           "P2PTRAIN_LINK_OVERRIDES": "0->1:latency=1ms; 1->0:latency=2ms"}
    table = NodeConfig.from_sources(toml_path=path, env=env).link_table()  # env beats TOML
    assert table.spec_for(0, 1) == LinkSpec(125e6, 0.001) and table.spec_for(1, 0) == LinkSpec(125e6, 0.002)
    assert NodeConfig.from_sources(env={}).link_table() is None  # off by default


@pytest.mark.parametrize("flags, message", [
    ({"link": "bandwidth=10mbps"}, "link emulation: unknown bandwidth unit 'mbps'"),
    ({"link": "drop=1.5"}, r"link emulation: drop probability must be in \[0, 1\)"),
    ({"link_overrides": "0->5:latency=1ms"}, r"link emulation: link override 0->5 names a rank outside 0\.\.1"),
    ({"link_overrides": "0=>1:latency=1ms"}, "link emulation: link override '0=>1:latency=1ms' is not"),
])
def test_bad_link_settings_raise_config_error(flags, message):
    with pytest.raises(ConfigError, match=message):
        NodeConfig.from_sources(env={}, flags={"world_size": 2, "peers": PEERS2, **flags})


def test_links_stay_out_of_the_fingerprint_and_reach_the_transport():
    base = NodeConfig(world_size=2, peers=PEERS2.split(","))
    lossy = NodeConfig(world_size=2, peers=PEERS2.split(","), link="drop=0.1", link_overrides=["0->1:latency=1ms"])
    assert base.fingerprint() == lossy.fingerprint()  # links may differ per node
    node = Node(lossy, device=torch.device("cpu"))  # not started: no sockets
    assert node.transport.options.links == lossy.link_table()
    assert Node(base, device=torch.device("cpu")).transport.options.links is None

