"""The TCP lane (p2ptrain/transport/paths/lane_path.py, lane_server.py, paths/router.py) over real
sockets on 127.0.0.1: negotiation in Hello and the data_plane setting, and a node's lane against a
raw client that writes frames by hand (tests/rawlane.py): the same validation and Acks as
PushTensor, exactly once, bad frames refused, half-open connections reaped and capped, the token
proof checked."""
from __future__ import annotations

import math
import threading
import time

import pytest
import torch

from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.choices import DATA_PLANE_NAMES
from p2ptrain.metrics import NodeMetrics
from p2ptrain.settings import ConfigError, NodeConfig
from p2ptrain.transport import FailureKind, PeerError, SendFailure, Transport, TransportOptions
from p2ptrain.transport.laneframes import MAX_FRAME_BYTES, PREFIX, encode
from p2ptrain.transport.options import DataPlane
from p2ptrain.transport.paths.lane_path import LanePorts
from tests.rawlane import RawLane
from tests.test_transport import (
    FAST,
    KIND,
    NUMEL,
    PAYLOAD,
    PAYLOAD_BYTES,
    header,
    in_progress,
    loopback_addresses,
    nodes,
    on_loop,
    pending,
    rejections,
    sample,
    wait_until,
)

torch.set_num_threads(1)
pytestmark = pytest.mark.timeout(60)

TOKEN = "lane-test-token"


def lane_messages(t: Transport, peer: int) -> float:
    return sample(t, "p2ptrain_lane_messages_total", node=str(t.rank), peer=str(peer)) or 0.0


def buffered_bytes(t: Transport) -> int:
    return on_loop(t, lambda: t.inbox.buffered_bytes)


def options(plane: str, **kw) -> TransportOptions:
    return TransportOptions(shutdown_grace=0.2, send_timeout=20.0, data_plane=plane, **kw)


# -- negotiation -----------------------------------------------------------------------------------
def test_hello_advertises_the_lane_and_auto_sends_over_it():
    with nodes(2) as t:
        assert t[0].lane_port > 0 and t[1].lane_port > 0 and t[0].lane_port != t[1].lane_port
        assert t[0].membership.hello(1).lane_port == t[1].lane_port
        t[1].expect(KIND, torch.float32, NUMEL)
        ack = t[0].sender.send(1, PAYLOAD, kind=KIND, step=0, ps_weight=0.5).result(20)
        assert ack.status == pb.Ack.STATUS_ACCEPTED and ack.bytes_received == 4 * NUMEL
        (message,) = t[1].recv(KIND, 0, [0], timeout=5).values()
        assert torch.equal(message.tensor, PAYLOAD) and message.message_id == ack.message_id
        assert lane_messages(t[0], 1) == 1
        assert t[0].metrics.bytes_sent_total == t[1].metrics.bytes_received_total == 4 * NUMEL


def test_auto_uses_grpc_where_a_peer_offers_no_lane():
    peers = loopback_addresses(2)
    with nodes(2, [0], peers=peers) as a, nodes(2, [1], peers=peers, options=options("grpc")) as b:
        assert b[1].lane_port == 0 and a[0].membership.hello(1).lane_port == 0
        b[1].expect(KIND, torch.float32, NUMEL)
        assert a[0].sender.send(1, PAYLOAD, kind=KIND, step=0).result(20).status == pb.Ack.STATUS_ACCEPTED
        assert torch.equal(b[1].recv(KIND, 0, [0], timeout=5)[0].tensor, PAYLOAD)
        assert lane_messages(a[0], 1) == 0  # it went by gRPC


def test_tcp_refuses_a_peer_without_a_lane_in_one_line():
    peers = loopback_addresses(2)
    with nodes(2, [0], peers=peers, options=options("tcp")) as a, nodes(2, [1], peers=peers, options=options("grpc")):
        with pytest.raises(PeerError, match="node 0: node 1 offers no TCP lane, which data_plane=tcp requires") as info:
            a[0].membership.wait_for_peers(timeout=5)
        assert "\n" not in str(info.value)
        with pytest.raises(PeerError, match="offers no TCP lane"):
            a[0].sender.send(1, PAYLOAD, kind=KIND, step=0).result(20)


def test_a_stale_lane_port_is_asked_again_and_the_new_one_used():
    """A lane port that refuses connections (a restarted peer listens elsewhere now): nothing was
    sent, so the sender asks the peer's Hello again and uses the lane it names."""
    dead_port = int(loopback_addresses(1)[0].rsplit(":", 1)[1])
    with nodes(2) as t:
        t[1].expect(KIND, torch.float32, NUMEL)
        on_loop(t[0], t[0].lane_ports.learn, 1, dead_port)  # as if node 1 had advertised it
        assert t[0].sender.send(1, PAYLOAD, kind=KIND, step=0).result(20).status == pb.Ack.STATUS_ACCEPTED
        assert lane_messages(t[0], 1) == 1
        assert torch.equal(t[1].recv(KIND, 0, [0], timeout=5)[0].tensor, PAYLOAD)


@pytest.mark.parametrize("plane", ["auto", "tcp"])
def test_a_lane_that_cannot_be_reached_falls_back_to_grpc_or_fails_under_tcp(plane):
    """The peer answers Hello but its lane refuses connections: auto sends by gRPC (nothing went
    over the lane), tcp fails the push as unreachable."""
    with nodes(2, options=options(plane)) as t:
        t[1].expect(KIND, torch.float32, NUMEL)
        t[1].loop.submit(t[1].lane_server.stop()).result(10)  # its Hello still names the port
        future = t[0].sender.send(1, PAYLOAD, kind=KIND, step=0)
        if plane == "tcp":
            with pytest.raises(SendFailure) as failed:
                future.result(20)
            assert failed.value.kind is FailureKind.UNREACHABLE and "connection refused" in failed.value.detail
            return
        assert future.result(20).status == pb.Ack.STATUS_ACCEPTED and lane_messages(t[0], 1) == 0
        assert torch.equal(t[1].recv(KIND, 0, [0], timeout=5)[0].tensor, PAYLOAD)
        assert t[0].sender.send(1, PAYLOAD, kind=KIND, step=1).result(20).status == pb.Ack.STATUS_ACCEPTED
        assert lane_messages(t[0], 1) == 0  # not tried again for relay_retry_after seconds


def test_a_lane_with_a_wrong_token_is_refused_end_to_end():
    from p2ptrain.transport.security import Security

    peers = loopback_addresses(2)
    good, bad = (options("tcp", security=Security(token=token)) for token in (TOKEN, "not-the-token"))
    with nodes(2, [1], peers=peers, options=good) as b, nodes(2, [0], peers=peers, options=bad) as a:
        b[1].expect(KIND, torch.float32, NUMEL)
        on_loop(a[0], a[0].lane_ports.learn, 1, b[1].lane_port)  # (its Hello would be refused already)
        with pytest.raises(SendFailure) as refused:
            a[0].sender.send(1, PAYLOAD, kind=KIND, step=0).result(20)
        assert refused.value.kind is FailureKind.DENIED
        assert "not-the-token" not in str(refused.value) and TOKEN not in str(refused.value)
        assert rejections(b[1]) == {"unauthenticated": 1.0} and pending(b[1]) == 0


@pytest.mark.parametrize("settings, message", [
    ({"data_plane": "udp"}, "unknown data_plane 'udp'"),
    ({"lane_port": 70000}, "lane_port must be a port number"),
    ({"data_plane": "grpc", "lane_port": 5000}, "data_plane grpc offers no TCP lane"),
])
def test_bad_data_plane_settings_are_config_errors(settings, message):
    with pytest.raises(ConfigError, match=message):
        NodeConfig(world_size=2, peers=["127.0.0.1:1", "127.0.0.1:2"], **settings).validate()


def test_data_plane_settings_from_flags_env_and_toml(tmp_path):
    from p2ptrain import cli
    from p2ptrain.node import transport_options

    assert tuple(DataPlane.__args__) == DATA_PLANE_NAMES  # the settings' and the transport's spelling agree
    base = ["--world-size", "2", "--peers", "127.0.0.1:1,127.0.0.1:2"]
    config = cli.config_from_args(cli.build_parser().parse_args(["node", *base, "--data-plane", "tcp",
                                                                  "--lane-port", "5077"]))
    assert (config.data_plane, config.lane_port) == ("tcp", 5077)
    opts = transport_options(config, torch.device("cpu"))
    assert (opts.data_plane, opts.lane_port) == ("tcp", 5077)
    assert NodeConfig().data_plane == "auto" and TransportOptions().data_plane == "auto"
    env = NodeConfig.from_sources(env={"P2PTRAIN_DATA_PLANE": "grpc", "P2PTRAIN_WORLD_SIZE": "2",
                                       "P2PTRAIN_PEERS": "127.0.0.1:1,127.0.0.1:2"})
    assert env.data_plane == "grpc"
    toml = tmp_path / "node.toml"
    toml.write_text('world_size = 2\npeers = ["127.0.0.1:1", "127.0.0.1:2"]\ndata_plane = "tcp"\nlane_port = 0\n')
    assert NodeConfig.from_sources(toml_path=toml, env={}).data_plane == "tcp"


# -- a raw client against a node's lane ------------------------------------------------------------
@pytest.fixture
def lane(receiver):
    """An authenticated raw lane connection as node 0 to the `receiver` fixture (node 1)."""
    with RawLane(receiver.lane_port) as connection:
        assert connection.verdict.accepted
        yield connection


def test_raw_lane_message_is_delivered_and_the_connection_reused(receiver, lane):
    assert lane.challenge.protocol_version == "p2ptrain-lane/1" and len(lane.challenge.nonce) == 32
    assert not lane.challenge.token_required
    for step in (0, 1):
        ack = lane.push(header(step=step), PAYLOAD_BYTES)
        assert ack.status == pb.Ack.STATUS_ACCEPTED and ack.bytes_received == 4 * NUMEL
    assert [torch.equal(m.tensor, PAYLOAD) for m in receiver.take(KIND, 1)] == [True, True]
    assert sample(receiver, "p2ptrain_received_messages_total", node="1", peer="0") == 2


LANE_REJECTIONS = {
    "wrong_dtype": (header(dtype=pb.DTYPE_FLOAT16, payload_bytes=2 * NUMEL), "bad_dtype"),
    "wrong_numel": (header(numel=NUMEL - 1, shape=[NUMEL - 1], payload_bytes=4 * (NUMEL - 1)), "bad_size"),
    "shape": (header(shape=[10, 10]), "bad_shape"),
    "codec": (header(codec=7), "bad_codec"),
    "void_where_not_declared": (header(codec=pb.CODEC_VOID, payload_bytes=0, ps_weight=0.0), "bad_codec"),
    "another_sender": (header(sender=2), "wrong_sender"),  # the connection authenticated as node 0
    "wrong_receiver": (header(receiver=2), "wrong_receiver"),
    "route": (header(route=[1]), "bad_route"),
    "kind": (header(kind=pb.MESSAGE_KIND_GOSSIP), "unexpected_kind"),
    "future_step": (header(step=1000), "future_step"),
    "nan_weight": (header(ps_weight=math.nan), "bad_weight"),
}


@pytest.mark.parametrize("name", sorted(LANE_REJECTIONS))
def test_bad_header_is_rejected_and_the_connection_stays_in_step(receiver, lane, name):
    """The refused message's payload is read and dropped, so the next message on the same
    connection is read from its own first byte."""
    h, reason = LANE_REJECTIONS[name]
    ack = lane.push(h, bytes(h.payload_bytes))
    assert (ack.status, ack.reason) == (pb.Ack.STATUS_REJECTED, reason) and ack.detail, ack
    assert rejections(receiver) == {reason: 1.0}
    assert pending(receiver) == 0 and in_progress(receiver) == set() and buffered_bytes(receiver) == 0
    ack = lane.push(header(step=1), PAYLOAD_BYTES)
    assert ack.status == pb.Ack.STATUS_ACCEPTED, ack
    assert torch.equal(receiver.take(KIND, 1)[0].tensor, PAYLOAD)


def test_a_void_notice_crosses_the_lane_as_a_header(receiver, lane):
    """A header-only CODEC_VOID notice (no payload bytes) is delivered, and the connection reads the
    next message from its own first byte."""
    receiver.expect(KIND, torch.float32, NUMEL, voidable=True)
    ack = lane.push(header(codec=pb.CODEC_VOID, payload_bytes=0, ps_weight=0.0), b"")
    assert (ack.status, ack.bytes_received) == (pb.Ack.STATUS_ACCEPTED, 0), ack
    (notice,) = receiver.take(KIND, 0)
    assert notice.tensor.numel() == 0 and notice.ps_weight == 0.0
    assert lane.push(header(step=1), PAYLOAD_BYTES).status == pb.Ack.STATUS_ACCEPTED
    assert torch.equal(receiver.take(KIND, 1)[0].tensor, PAYLOAD)


def test_non_finite_payload_is_refused_after_it_arrived(receiver, lane):
    values = PAYLOAD.clone()
    values[-1] = math.inf
    ack = lane.push(header(), values.numpy().tobytes())
    assert (ack.status, ack.reason) == (pb.Ack.STATUS_REJECTED, "non_finite")
    assert pending(receiver) == 0 and buffered_bytes(receiver) == 0


@pytest.mark.parametrize("frame, reason", [
    (PREFIX.pack(MAX_FRAME_BYTES + 1), "malformed_frame"),                    # a length no header has
    (PREFIX.pack(5) + b"\xff\xff\xff\xff\xff", "malformed_frame"),           # no TensorHeader
    (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", "malformed_frame"),                 # another protocol
])
def test_malformed_frame_is_refused_and_the_connection_closed(receiver, lane, frame, reason):
    lane.send(frame)
    ack = lane.ack()
    assert (ack.status, ack.reason) == (pb.Ack.STATUS_REJECTED, reason) and ack.detail
    assert lane.closed_by_peer()
    assert rejections(receiver) == {reason: 1.0} and pending(receiver) == 0
    with RawLane(receiver.lane_port) as again:  # the node keeps serving
        assert again.push(header(), PAYLOAD_BYTES).status == pb.Ack.STATUS_ACCEPTED


# -- exactly once ----------------------------------------------------------------------------------
def test_same_id_twice_is_acknowledged_duplicate_and_delivered_once(receiver, lane):
    h = header()
    assert lane.push(h, PAYLOAD_BYTES).status == pb.Ack.STATUS_ACCEPTED
    again = lane.push(h, PAYLOAD_BYTES)  # a retry whose first copy did arrive
    assert (again.status, again.reason) == (pb.Ack.STATUS_DUPLICATE, "duplicate")
    assert len(receiver.take(KIND, 0)) == 1


def test_connection_cut_mid_payload_delivers_nothing_and_the_retry_is_accepted(receiver, lane):
    h = header()
    lane.send(encode(h), PAYLOAD_BYTES[:1500])
    wait_until(lambda: (0, h.message_id) in in_progress(receiver), what="the reception")
    lane.close()
    wait_until(lambda: not in_progress(receiver), what="the reception to be dropped")
    assert rejections(receiver) == {"aborted_stream": 1.0} and pending(receiver) == 0
    assert buffered_bytes(receiver) == 0
    with RawLane(receiver.lane_port) as retry:  # the same id: it was never delivered
        assert retry.push(h, PAYLOAD_BYTES).status == pb.Ack.STATUS_ACCEPTED
    (message,) = receiver.take(KIND, 0)
    assert message.message_id == h.message_id and torch.equal(message.tensor, PAYLOAD)


def test_two_connections_one_id_first_to_complete_is_delivered(receiver, lane):
    """DUPLICATE means delivered: the copy that completes first is ACCEPTED, the other DUPLICATE."""
    h = header()
    lane.send(encode(h), PAYLOAD_BYTES[:2000])
    wait_until(lambda: (0, h.message_id) in in_progress(receiver), what="the first copy")
    with RawLane(receiver.lane_port) as second:
        assert second.push(h, PAYLOAD_BYTES).status == pb.Ack.STATUS_ACCEPTED
    lane.send(PAYLOAD_BYTES[2000:])
    late = lane.ack()
    assert (late.status, late.reason) == (pb.Ack.STATUS_DUPLICATE, "duplicate")
    assert len(receiver.take(KIND, 0)) == 1 and buffered_bytes(receiver) == 0


# -- half-open and too many connections ------------------------------------------------------------
IDLE = 1.0


def test_idle_connection_mid_message_is_cut_and_its_buffer_released(receiver, lane):
    on_loop(receiver, setattr, receiver.inbox, "stream_idle_timeout", IDLE)
    h = header()
    started = time.monotonic()
    lane.send(encode(h), PAYLOAD_BYTES[:1024])
    wait_until(lambda: buffered_bytes(receiver) == 4 * NUMEL, what="the half-sent message's buffer")
    ack = lane.ack()
    elapsed = time.monotonic() - started
    assert (ack.status, ack.reason) == (pb.Ack.STATUS_REJECTED, "idle_stream")
    assert IDLE <= elapsed < IDLE + 3, elapsed
    assert lane.closed_by_peer()
    assert rejections(receiver) == {"idle_stream": 1.0}
    assert buffered_bytes(receiver) == 0 and in_progress(receiver) == set() and pending(receiver) == 0


def test_a_payload_that_trickles_in_below_the_low_water_mark_is_not_cut_as_idle(receiver, lane):
    """Lane reads wait for a MiB of payload at a time (SO_RCVLOWAT: fewer wake-ups per GB). A slow
    link that brings less than that per idle timeout still keeps its stream: the idle check finds
    the bytes waiting in the socket and reads them, and the message arrives whole."""
    numel = 300_000  # 1.2 MB, more than the low-water mark; 32 KB every 0.1 s take 3.2 s per MiB
    receiver.expect(KIND, torch.float32, numel, channel="slow")
    on_loop(receiver, setattr, receiver.inbox, "stream_idle_timeout", IDLE)
    payload = torch.arange(numel, dtype=torch.float32)
    data = payload.numpy().tobytes()
    lane.send(encode(header(numel=numel, shape=[numel], payload_bytes=4 * numel, channel="slow")))
    for offset in range(0, len(data), 32 * 1024):
        lane.send(data[offset:offset + 32 * 1024])
        time.sleep(0.1)
    ack = lane.ack()
    assert ack.status == pb.Ack.STATUS_ACCEPTED, ack
    (message,) = receiver.take(KIND, 0, channel="slow")
    assert torch.equal(message.tensor, payload) and rejections(receiver) == {}


def test_connection_that_never_authenticates_is_closed(receiver):
    on_loop(receiver, setattr, receiver.inbox, "stream_idle_timeout", IDLE)
    with RawLane(receiver.lane_port, sender=None) as silent:
        started = time.monotonic()
        assert silent.closed_by_peer(timeout=IDLE + 4)
        assert IDLE <= time.monotonic() - started < IDLE + 3


def test_open_messages_per_sender_are_capped(receiver):
    cap = receiver.inbox.max_receptions_per_sender
    held = [RawLane(receiver.lane_port) for _ in range(cap + 1)]
    try:
        for step, connection in enumerate(held[:cap]):
            connection.send(encode(header(step=step)), PAYLOAD_BYTES[:100])
        wait_until(lambda: len(in_progress(receiver)) == cap, what=f"{cap} open receptions")
        refused = held[cap].push(header(step=cap), PAYLOAD_BYTES)
        assert (refused.status, refused.reason) == (pb.Ack.STATUS_REJECTED, "too_many_streams")
        with RawLane(receiver.lane_port, sender=2) as other:  # another sender is not affected
            assert other.push(header(sender=2), PAYLOAD_BYTES).status == pb.Ack.STATUS_ACCEPTED
        for connection in held[:cap]:
            connection.send(PAYLOAD_BYTES[100:])
            assert connection.ack().status == pb.Ack.STATUS_ACCEPTED
    finally:
        for connection in held:
            connection.close()
    assert len(receiver.take(KIND, 100)) == cap + 1 and buffered_bytes(receiver) == 0


def test_connections_per_sender_are_capped(receiver):
    limit = 2 * receiver.inbox.max_receptions_per_sender
    connections = [RawLane(receiver.lane_port) for _ in range(limit)]
    try:
        assert all(c.verdict.accepted for c in connections)
        with RawLane(receiver.lane_port) as one_too_many:
            assert not one_too_many.verdict.accepted and one_too_many.verdict.reason == "too_many_connections"
            assert one_too_many.closed_by_peer()
    finally:
        for c in connections:
            c.close()
    wait_until(lambda: on_loop(receiver, lambda: not receiver.lane_server.per_sender), what="the lanes to close")
    with RawLane(receiver.lane_port) as fresh:
        assert fresh.verdict.accepted


# -- the token proof -------------------------------------------------------------------------------
@pytest.fixture
def guarded():
    """Node 1 of 3 whose lane (and gRPC server) wants the token."""
    from p2ptrain.transport.security import Security

    with nodes(3, [1], options=options("auto", security=Security(token=TOKEN))) as t:
        t[1].expect(KIND, torch.float32, NUMEL)
        yield t[1]


@pytest.mark.parametrize("how", ["no proof", "wrong token", "proof for another receiver", "replayed proof"])
def test_lane_without_the_right_token_proof_is_refused(guarded, how):
    from p2ptrain.transport.laneframes import auth_proof

    proof = {"no proof": b"", "wrong token": None, "proof for another receiver": auth_proof(TOKEN, b"n" * 32, 0, 2),
             "replayed proof": None}[how]
    token = "wrong" if how == "wrong token" else TOKEN
    if how == "replayed proof":  # a proof that was good on another connection (another nonce)
        with RawLane(guarded.lane_port, token=TOKEN) as first:
            assert first.verdict.accepted
            proof = auth_proof(TOKEN, first.challenge.nonce, 0, 1)
    with RawLane(guarded.lane_port, token=token, proof=proof) as stranger:
        assert stranger.challenge.token_required
        assert not stranger.verdict.accepted and stranger.verdict.reason == "unauthenticated"
        assert TOKEN not in stranger.verdict.detail
        assert stranger.closed_by_peer()
    assert rejections(guarded) == {"unauthenticated": 1.0} and pending(guarded) == 0
    with RawLane(guarded.lane_port, token=TOKEN) as friend:
        assert friend.verdict.accepted
        assert friend.push(header(), PAYLOAD_BYTES).status == pb.Ack.STATUS_ACCEPTED


def test_lane_holds_nothing_after_many_broken_connections(receiver):
    """Memory stays bounded: 50 connections cut in every phase leave no reception, buffer or
    connection behind."""
    def cut(i: int) -> None:
        connection = RawLane(receiver.lane_port, sender=None if i % 3 == 0 else 0)
        if i % 3 == 1:
            connection.send(encode(header(step=i % 8)), PAYLOAD_BYTES[: 50 * i])
        connection.close()

    threads = [threading.Thread(target=cut, args=(i,)) for i in range(50)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    wait_until(lambda: on_loop(receiver, lambda: not receiver.lane_server.connections), what="every lane closed")
    assert in_progress(receiver) == set() and buffered_bytes(receiver) == 0 and pending(receiver) == 0
    assert on_loop(receiver, lambda: receiver.lane_server.handshaking) == 0
    with RawLane(receiver.lane_port) as fine:
        assert fine.push(header(), PAYLOAD_BYTES).status == pb.Ack.STATUS_ACCEPTED


def test_tcp_plane_needs_a_host_port_listen_address(tmp_path):
    with pytest.raises(PeerError, match="data_plane=tcp needs a host:port listen address"):
        Transport(0, 1, ["127.0.0.1:1"], listen=f"unix:{tmp_path}/node.sock", options=options("tcp"),
                  metrics=NodeMetrics(0)).start(timeout=10)


def test_transport_default_options_reach_every_data_plane():
    for plane in DATA_PLANE_NAMES:
        with nodes(2, options=options(plane)) as t:
            t[1].expect(KIND, torch.float32, NUMEL)
            assert t[0].sender.send(1, PAYLOAD, kind=KIND, step=0).result(20).status == pb.Ack.STATUS_ACCEPTED
            assert lane_messages(t[0], 1) == (0 if plane == "grpc" else 1)
            assert (t[1].lane_port == 0) == (plane == "grpc")
    assert FAST.data_plane == "auto"


@pytest.mark.parametrize("where", ["first", "last", "nowhere"])
def test_payload_larger_than_a_scan_is_checked_whole(where):
    """The lane checks a big payload for NaN in pieces as it arrives (Inbox.scan); a NaN in the
    first piece or after the last one is refused alike."""
    from p2ptrain.transport.lane_server import SCAN_BYTES

    numel = 3 * SCAN_BYTES // 4 + 5  # three scans and a tail
    values = torch.ones(numel)
    if where != "nowhere":
        values[0 if where == "first" else -1] = math.nan
    with nodes(3, [1]) as t, RawLane(t[1].lane_port) as lane:
        t[1].expect(KIND, torch.float32, numel)
        ack = lane.push(header(numel=numel, shape=[numel], payload_bytes=4 * numel), values.numpy().tobytes())
        if where == "nowhere":
            assert ack.status == pb.Ack.STATUS_ACCEPTED, ack
            assert torch.equal(t[1].take(KIND, 0)[0].tensor, values)
        else:
            assert (ack.status, ack.reason) == (pb.Ack.STATUS_REJECTED, "non_finite"), ack
            assert pending(t[1]) == 0 and buffered_bytes(t[1]) == 0


@pytest.mark.parametrize("plane", ["lane", "grpc"])
def test_a_channel_that_measures_peaks_gets_each_payloads_max_magnitude_and_still_refuses_nan(plane):
    """Inbox.expect(peak=True): the NaN / Inf pass over a raw payload is max |v| (push-sum's
    plausibility check reads Message.peak instead of two more passes on the training thread), over
    every piece the lane scans and the tail; gRPC's whole-payload check gives the same."""
    from p2ptrain.transport.lane_server import SCAN_BYTES

    numel = 3 * SCAN_BYTES // 4 + 5  # three scans and a tail
    values = torch.linspace(-1.0, 1.0, numel)
    values[-1] = -7.5  # the peak, in the tail
    values[SCAN_BYTES // 4 + 3] = 6.0  # second to it, in the second piece
    nan_inside = values.clone()
    nan_inside[SCAN_BYTES // 4 + 4] = math.nan
    with nodes(2, options=options(plane)) as t:
        t[1].expect(KIND, torch.float32, numel, peak=True)
        t[1].expect(KIND + 1, torch.float32, numel)
        for kind in (KIND, KIND + 1):
            assert t[0].sender.send(1, values, kind=kind, step=0).result(20).status == pb.Ack.STATUS_ACCEPTED
        (measured,) = t[1].recv(KIND, 0, [0], timeout=5).values()
        (unmeasured,) = t[1].recv(KIND + 1, 0, [0], timeout=5).values()
        assert measured.peak == 7.5 and torch.equal(measured.tensor, values)
        assert unmeasured.peak is None
        ack = t[0].sender.send(1, nan_inside, kind=KIND, step=1).result(20)
        assert (ack.status, ack.reason) == (pb.Ack.STATUS_REJECTED, "non_finite"), ack
        assert lane_messages(t[0], 1) == (3 if plane == "lane" else 0)


@pytest.mark.parametrize("shared_memory", [True, False])
def test_payloads_between_nodes_of_one_host_go_through_shared_memory_where_they_fit(shared_memory):
    """A new lane connection offers a segment sized for its first payload (shared_segment.py); the
    receiver, in the same network namespace, takes it, and every payload that fits travels through
    it (one copy in, one out, checked as ever), a larger one over TCP. Off: all of them over TCP."""
    from p2ptrain.transport.shared_segment import MIN_PAYLOAD_BYTES

    small, large = torch.arange(1000, dtype=torch.float32), torch.ones(MIN_PAYLOAD_BYTES // 2 + 1)
    nan = small.clone()
    nan[999] = math.nan
    with nodes(2, options=options("tcp", shared_memory=shared_memory)) as t:
        t[1].expect(KIND, torch.float32, small.numel())
        t[1].expect(KIND + 1, torch.float32, large.numel())
        sends = [(KIND, 0, small), (KIND + 1, 0, large), (KIND, 1, small * 2), (KIND, 2, nan)]
        acks = [t[0].sender.send(1, values, kind=kind, step=step).result(20) for kind, step, values in sends]
        assert [a.status for a in acks[:3]] == [pb.Ack.STATUS_ACCEPTED] * 3
        assert (acks[3].status, acks[3].reason) == (pb.Ack.STATUS_REJECTED, "non_finite")
        for kind, step, values in sends[:3]:
            (message,) = t[1].recv(kind, step, [0], timeout=5).values()
            assert torch.equal(message.tensor, values)
        assert t[0].lanes.shared_messages == (3 if shared_memory else 0)  # the NaN one too (refused)
        assert lane_messages(t[0], 1) == 4


def test_shared_memory_is_on_unless_the_setting_or_the_flag_turns_it_off():
    import argparse

    from p2ptrain.cli.flags import add_node_arguments, config_from_args, node_flags_as_argv
    from p2ptrain.settings import NodeConfig

    cluster = {"P2PTRAIN_RANK": "0", "P2PTRAIN_WORLD_SIZE": "2", "P2PTRAIN_PEERS": "127.0.0.1:1,127.0.0.1:2"}
    on = NodeConfig.from_sources(env=cluster)
    off = NodeConfig.from_sources(env={**cluster, "P2PTRAIN_SHARED_MEMORY": "0"})
    assert TransportOptions.from_settings(on.transport).shared_memory
    assert not TransportOptions.from_settings(off.transport).shared_memory
    parser = argparse.ArgumentParser()
    add_node_arguments(parser)
    cluster_flags = ["--rank", "0", "--world-size", "2", "--peers", "127.0.0.1:1,127.0.0.1:2"]
    for given, expected, passed_on in ([], True, []), (["--no-shared-memory"], False, ["--no-shared-memory"]), \
                                      (["--shared-memory"], True, ["--shared-memory"]):
        args = parser.parse_args(cluster_flags + given)
        assert config_from_args(args).transport.shared_memory is expected, given
        assert [f for f in node_flags_as_argv(args) if "shared-memory" in f] == passed_on  # (to launched nodes)


def test_a_segment_is_sized_in_whole_mib_for_its_first_payload_and_bounded():
    from p2ptrain.transport.shared_segment import MAX_PAYLOAD_BYTES, capacity_for

    assert [capacity_for(n) for n in (1, 1 << 20, (1 << 20) + 1, 3_700_000)] == [1 << 20, 1 << 20, 2 << 20, 4 << 20]
    assert capacity_for(1 << 40) == MAX_PAYLOAD_BYTES  # a bigger payload goes over TCP


def test_a_shared_memory_offer_that_cannot_be_used_is_declined_and_payloads_travel_over_tcp():
    """The receiver maps only a sealed segment of the announced size holding the announced nonce,
    of a process in its own network namespace; otherwise it says no (the connection stays) and the
    sender's payloads come over the socket."""
    import mmap
    import os

    from p2ptrain.transport.shared_segment import HEADER_BYTES, OwnSegment

    nonce = b"n" * 16
    good = OwnSegment(1 << 20, nonce)
    unsealed = os.memfd_create("unsealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(unsealed, HEADER_BYTES + (1 << 20))
    with mmap.mmap(unsealed, HEADER_BYTES) as view:
        view[:16] = nonce
    offers = {
        "unsealed (a sender could shrink it under the reader)": dict(shm_fd=unsealed),
        "another nonce": dict(shm_fd=good.fd, shm_nonce=b"x" * 16),
        "another size": dict(shm_fd=good.fd, shm_capacity=2 << 20),
        "no such descriptor": dict(shm_fd=9999),
        "no such process": dict(shm_pid=(1 << 22) + 1),
        "a negative descriptor": dict(shm_fd=-1),
    }
    try:
        with nodes(3, [1], options=options("auto", shared_memory=True)) as t:
            t[1].expect(KIND, torch.float32, NUMEL)
            for step, (what, fields) in enumerate(offers.items()):
                offer = {"shm_pid": os.getpid(), "shm_capacity": 1 << 20, "shm_nonce": nonce, **fields}
                with RawLane(t[1].lane_port, offer=offer) as lane:
                    assert lane.verdict.accepted and not lane.verdict.shared_memory, what
                    ack = lane.push(header(step=step), PAYLOAD.numpy().tobytes())
                    assert ack.status == pb.Ack.STATUS_ACCEPTED, (what, ack)
                    assert torch.equal(t[1].take(KIND, step)[0].tensor, PAYLOAD)
            with RawLane(t[1].lane_port, offer={"shm_pid": os.getpid(), "shm_fd": good.fd,
                                                "shm_capacity": 1 << 20, "shm_nonce": nonce}) as lane:
                assert lane.verdict.shared_memory  # the good one is taken: the payload is in it, not sent
                good.write(memoryview(PAYLOAD.numpy()).cast("B"))
                lane.send(encode(header(step=9)))
                assert lane.ack().status == pb.Ack.STATUS_ACCEPTED
                assert torch.equal(t[1].take(KIND, 9)[0].tensor, PAYLOAD)
    finally:
        good.close()
        os.close(unsealed)


def test_a_segment_of_a_process_in_another_network_namespace_is_not_taken():
    """Network namespaces are hosts to the lane (the netns clusters, tc-shaped links, NAT): a
    process of another one gets TCP, whatever memory it could share."""
    import subprocess
    import sys

    from p2ptrain.transport.shared_segment import PeerSegment

    script = ("from p2ptrain.transport.shared_segment import OwnSegment; import sys; "
              "s = OwnSegment(1 << 20, b'n' * 16); print(s.pid, s.fd, flush=True); sys.stdin.read()")
    try:
        child = subprocess.Popen(["unshare", "--net", sys.executable, "-c", script], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    except FileNotFoundError:
        pytest.skip("no unshare here")
    try:
        line = child.stdout.readline()
        if not line:
            pytest.skip(f"unshare --net is not allowed here: {child.stderr.read().strip()}")
        pid, fd = map(int, line.split())
        with pytest.raises(ValueError, match="another network namespace"):
            PeerSegment.open(pid, fd, 1 << 20, b"n" * 16)
    finally:
        child.kill()
        child.wait()


def test_payload_is_read_into_the_buffer_the_message_views_and_scanned_as_it_arrives(monkeypatch):
    """One copy and one pass: the lane reads payload bytes straight into the pooled buffer the
    delivered tensor views (never through Reception.write, gRPC's copy-in), and checks what has
    arrived for NaN / Inf while the rest is on its way, so deliver() looks only at a tail."""
    from p2ptrain.transport.inbox import Inbox, Reception
    from p2ptrain.transport.lane_server import SCAN_BYTES

    def copied(reception, data):
        raise AssertionError("the lane copied a payload chunk in")

    scans, scanned_at_delivery = [], []
    scan, deliver = Inbox.scan, Inbox.deliver

    def scanning(inbox, reception):
        scan(inbox, reception)
        scans.append(reception.scanned)

    def delivering(inbox, reception):
        scanned_at_delivery.append(reception.scanned)
        return deliver(inbox, reception)

    monkeypatch.setattr(Reception, "write", copied)
    monkeypatch.setattr(Inbox, "scan", scanning)
    monkeypatch.setattr(Inbox, "deliver", delivering)
    numel = 3 * SCAN_BYTES // 4 + 5  # three scans and a tail
    values = torch.arange(numel, dtype=torch.float32) - numel // 2
    payload = values.numpy().tobytes()
    with nodes(3, [1]) as t, RawLane(t[1].lane_port) as lane:
        t[1].expect(KIND, torch.float32, numel, preallocate=1)

        def next_buffer() -> int:  # the pool hands out the buffer released last
            pool = t[1].inbox.pool
            buffer = pool.acquire(4 * numel)
            pool.release(buffer)
            return buffer.data_ptr()

        pooled = on_loop(t[1], next_buffer)
        lane.send(encode(header(numel=numel, shape=[numel], payload_bytes=4 * numel)), payload[:2 * SCAN_BYTES])
        wait_until(lambda: scans, what="a scan of the first part while the rest is not sent yet")
        lane.send(payload[2 * SCAN_BYTES:])
        ack = lane.ack()
        assert ack.status == pb.Ack.STATUS_ACCEPTED, ack
        (message,) = t[1].take(KIND, 0)
        assert message.tensor.data_ptr() == pooled and torch.equal(message.tensor, values)
    assert scans[0] >= SCAN_BYTES and scanned_at_delivery == [max(scans)]


def test_a_restarted_peer_on_the_same_lane_port_gets_its_lane_tried_at_once():
    """A killed peer's lane refuses connections and is set aside (retry_after); its restart may
    listen on the same port (a launcher's fixed ports), and its new incarnation in a Hello brings
    the lane back at once instead of leaving its state transfer on gRPC for retry_after seconds."""
    ports = LanePorts(0, retry_after=30.0)
    ports.learn(1, 5000, incarnation=11)
    ports.set_aside(1)
    ports.learn(1, 5000, incarnation=11)  # the same process's Hellos: still set aside
    assert ports.port_of(1) == 0
    ports.learn(1, 5000, incarnation=12)  # a new process on the same port
    assert ports.port_of(1) == 5000


def test_a_lane_message_without_an_ack_fails_at_its_timeout_and_the_lane_carries_on():
    """A receiver whose event loop is frozen (a GC pause, swap) reads nothing and Acks nothing: the
    send fails as a timeout at send_timeout, not later, and once the receiver is back the next
    message goes through."""
    with nodes(2, options=TransportOptions(shutdown_grace=0.2, send_timeout=1.0, data_plane="tcp",
                                           shared_memory=False)) as t:
        t[1].expect(KIND, torch.float32, NUMEL)
        assert t[0].sender.send(1, PAYLOAD, kind=KIND, step=0).result(20).status == pb.Ack.STATUS_ACCEPTED
        frozen, thawed = threading.Event(), threading.Event()
        t[1].loop.call_soon(lambda: (frozen.set(), time.sleep(5.0), thawed.set()))
        assert frozen.wait(5)
        began = time.monotonic()
        with pytest.raises(SendFailure) as failure:
            t[0].sender.send(1, PAYLOAD, kind=KIND, step=1).result(20)
        assert failure.value.kind == FailureKind.TIMEOUT and "no Ack within" in str(failure.value)
        assert time.monotonic() - began > 0.9 and not thawed.is_set()  # (the thaw did not end the wait)
        assert thawed.wait(10)
        assert t[0].sender.send(1, PAYLOAD, kind=KIND, step=2).result(20).status == pb.Ack.STATUS_ACCEPTED
