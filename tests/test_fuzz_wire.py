"""Property-based fuzzing of the wire against ONE real running node and parameter server.

Hypothesis generates TensorHeaders (every field, near-valid and arbitrary values, NaN/Inf weights)
and chunk streams (no header, two headers, bytes that are no TensorChunk, too few / too many bytes,
empty streams, huge announced sizes), sent with a raw gRPC client. Properties: a message is accepted
exactly when an independent oracle of the spec says it is valid; everything else gets a rejecting
Ack (or, for a message over the size limit, a clear RESOURCE_EXHAUSTED status), never a hang; the
inbox / θ are unchanged by rejected input, nothing is left half-received, and the node still answers
Hello and accepts a valid message afterwards. The node's TCP lane gets the same headers and oracle,
and arbitrary byte streams in place of its frames (lane_server.py, laneframes.py).
"""
from __future__ import annotations

import itertools
import math
import socket

import grpc
import pytest
import torch
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from launcher.ports import free_ports
from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.metrics import NodeMetrics
from p2ptrain.ps import ParameterServer
from p2ptrain.ps.server import COMMIT_METHOD, grpc_options
from p2ptrain.transport import Transport, TransportOptions
from p2ptrain.transport.framing import MIN_CHUNK_BYTES, encode_data, encode_header, serialize_identity
from p2ptrain.transport.laneframes import MAX_FRAME_BYTES, PREFIX, encode
from p2ptrain.transport.server import HELLO_METHOD, PROTOCOL_VERSION, PUSH_METHOD
from tests.rawlane import RawLane
from tests.test_transport import in_progress, on_loop, pending, wait_until

torch.set_num_threads(1)
pytestmark = pytest.mark.timeout(120)

KIND = pb.MESSAGE_KIND_GOSSIP
N = 16                 # elements the node expects per message
WINDOW = 8             # its step window
CHUNK = MIN_CHUNK_BYTES  # its chunk size: a message over chunk + 1 MiB is refused by gRPC itself
FUZZ = settings(max_examples=300, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
_ids = itertools.count(1)

U32, U64, I32 = st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1), st.integers(-2**31, 2**31 - 1)
I64 = st.integers(-2**63, 2**63 - 1)


FIELDS = ("sender", "receiver", "step", "kind", "dtype", "numel", "shape", "payload_bytes", "codec", "codec_params",
          "ps_weight", "relay_count", "channel", "route")


@st.composite
def headers(draw) -> pb.TensorHeader:
    """A valid header with 0-3 fields replaced by a neighbour of the valid value or anything of
    the field's type (so every check of the receiver is reached, not only the first one)."""
    broken = draw(st.sets(st.sampled_from(FIELDS), max_size=3))

    def pick(name, valid, others, anything):
        return draw(st.one_of(st.sampled_from(others), anything)) if name in broken else valid

    codec = pick("codec", pb.CODEC_NONE, [pb.CODEC_TRUNC16, pb.CODEC_INT8_QUANTIZE, pb.CODEC_FP16, 3, -1], I32)
    element_bytes = {pb.CODEC_TRUNC16: 2, pb.CODEC_INT8_QUANTIZE: 1}.get(codec, 4)
    params = [1.0] if codec == pb.CODEC_INT8_QUANTIZE else []
    return pb.TensorHeader(
        sender=pick("sender", draw(st.sampled_from([1, 2])), [0, 3], U32),
        receiver=pick("receiver", 0, [1, 2, 3], U32),
        step=pick("step", draw(st.integers(0, WINDOW)), [WINDOW + 1, 2**64 - 1], U64),
        kind=pick("kind", KIND, [pb.MESSAGE_KIND_PUSH_SUM, 0, 99], I32),
        dtype=pick("dtype", pb.DTYPE_FLOAT32, [pb.DTYPE_FLOAT16, 0, 42], I32),
        numel=pick("numel", N, [0, N - 1, N + 1, 2**63], U64),
        shape=pick("shape", draw(st.sampled_from([[N], [], [4, 4], [2, 8]])),
                   [[-4, -4], [-1, -16], [0], [N, 1], [N, 0]], st.lists(I64, max_size=4)),
        payload_bytes=pick("payload_bytes", N * element_bytes,
                           [0, N * element_bytes - 1, N * element_bytes + 1, 2**62, 2**64 - 1], U64),
        codec=codec,
        codec_params=pick("codec_params", params, [[], [1.0], [-1.0], [math.nan], [math.inf], [1.0, 2.0]],
                          st.lists(st.floats(), max_size=3)),
        ps_weight=pick("ps_weight", draw(st.floats(0, 1)),
                       [-1.0, -0.0, 3.0, 3.0000001, 1.7e308, math.nan, math.inf, -math.inf], st.floats()),
        relay_count=pick("relay_count", 0.0, [1.0, 3.0, 4.0, -1.0, 1.7e308, math.nan, -math.inf], st.floats()),
        channel=draw(st.sampled_from(["", "a", "ring:3"])) if "channel" not in broken else draw(st.text(max_size=12)),
        route=pick("route", [], [[1], [0], [0, 1]], st.lists(U32, max_size=3)),
        message_id=next(_ids),  # not fuzzed: duplicates are tested in test_transport
    )


WORLD = 3  # the node's world size: push-sum weights and relay counters lie in [0, WORLD]


def weights_valid(h: pb.TensorHeader) -> bool:
    """Push-sum mass never exceeds n (Σ w = n), a relay counter counts at most n models."""
    return 0 <= h.ps_weight <= WORLD and 0 <= h.relay_count <= WORLD  # (False for NaN)


def acceptable(h: pb.TensorHeader, sent: int) -> bool:
    """The spec (proto + Inbox docs), written independently of inbox.py: would a node expecting
    N float32 of KIND at step 0 (window WINDOW) from peers 1, 2 accept this message? (The payload
    sent is zeros: always finite.)"""
    codec_bytes = {pb.CODEC_NONE: 4, pb.CODEC_TRUNC16: 2, pb.CODEC_INT8_QUANTIZE: 1}
    codec_params = {pb.CODEC_NONE: 0, pb.CODEC_TRUNC16: 0, pb.CODEC_INT8_QUANTIZE: 1}
    return (h.sender in (1, 2) and h.receiver == 0 and h.kind == KIND and h.dtype == pb.DTYPE_FLOAT32
            and h.numel == N and (not h.shape or (all(d >= 0 for d in h.shape) and math.prod(h.shape) == N))
            and h.codec in codec_bytes and h.payload_bytes == codec_bytes[h.codec] * N
            and len(h.codec_params) == codec_params[h.codec]
            and all(math.isfinite(p) and p >= 0 for p in h.codec_params)
            and weights_valid(h) and h.step <= WINDOW
            and not h.route  # hops left: forwarded (to nodes 1, 2, which do not run) or refused
            and sent == h.payload_bytes)


@pytest.fixture(scope="module")
def node():
    """Node 0 of a 3-node world; nodes 1 and 2 never start (the fuzzer speaks for them)."""
    peers = [f"127.0.0.1:{p}" for p in free_ports(3)]
    transport = Transport(0, WORLD, peers, listen=peers[0], metrics=NodeMetrics(0),
                          options=TransportOptions(chunk_bytes=CHUNK, step_window=WINDOW, shutdown_grace=0.2,
                                                   send_timeout=1.0))  # a relay hop to a dead node
    transport.expect(KIND, torch.float32, N)
    transport.start()
    channel = grpc.insecure_channel(peers[0], options=TransportOptions().channel_options())
    transport.push = channel.stream_unary(PUSH_METHOD, request_serializer=serialize_identity,
                                          response_deserializer=pb.Ack.FromString)
    transport.raw_hello = channel.unary_unary(HELLO_METHOD, request_serializer=pb.HelloRequest.SerializeToString,
                                              response_deserializer=pb.HelloReply.FromString)
    yield transport
    channel.close()
    transport.stop()


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    return [data[a:b] for a, b in zip(points, points[1:])]


def _assert_node_healthy(node: Transport) -> None:
    """Nothing new in the inbox, nothing half-received, Hello answers, a valid message gets through."""
    assert pending(node) == 0
    assert in_progress(node) == set()
    reply = node.raw_hello(pb.HelloRequest(node_id=1, world_size=3, protocol_version=PROTOCOL_VERSION), timeout=5)
    assert reply.node_id == 0 and reply.compatible
    x = torch.arange(N, dtype=torch.float32)
    good = pb.TensorHeader(sender=2, receiver=0, step=1, kind=KIND, dtype=pb.DTYPE_FLOAT32, numel=N,
                           payload_bytes=4 * N, message_id=next(_ids))
    ack = node.push(iter([encode_header(good), encode_data(x.numpy().tobytes())]), timeout=10)
    assert ack.status == pb.Ack.STATUS_ACCEPTED, ack
    (message,) = node.take(KIND, 1)
    assert torch.equal(message.tensor, x)
    message.release()


def _drain(node: Transport, h: pb.TensorHeader) -> None:
    """Take an accepted message out again (and check it is the one sent), restoring the inbox."""
    (message,) = on_loop(node, node.inbox.take, KIND, h.step, h.channel)
    assert (message.sender, message.step, message.message_id) == (h.sender, h.step, h.message_id)
    message.release()


@FUZZ
@given(h=headers(), extra=st.integers(-3, 3), cuts=st.lists(st.integers(0, 4 * N), max_size=3))
@example(h=pb.TensorHeader(sender=1, receiver=0, kind=KIND, dtype=pb.DTYPE_FLOAT32, numel=N, shape=[-4, -4],
                           payload_bytes=4 * N), extra=0, cuts=[])  # negative dims whose product is N
@example(h=pb.TensorHeader(sender=1, receiver=0, kind=KIND, dtype=pb.DTYPE_FLOAT32, numel=N, payload_bytes=N,
                           codec=pb.CODEC_INT8_QUANTIZE, codec_params=[math.nan]), extra=0, cuts=[])
@example(h=pb.TensorHeader(sender=1, receiver=0, kind=KIND, dtype=pb.DTYPE_FLOAT32, numel=N, payload_bytes=N,
                           codec=pb.CODEC_TRUNC16), extra=0, cuts=[])  # trunc16 needs 2N bytes
def test_fuzzed_headers_are_accepted_exactly_when_valid(node, h, extra, cuts):
    before = pending(node)
    sent = max(0, min(h.payload_bytes, 4 * N + 8) + extra)  # about what was announced, capped
    ack = node.push(iter([encode_header(h), *(encode_data(c) for c in _split(bytes(sent), cuts))]), timeout=10)
    event(f"ack {pb.Ack.Status.Name(ack.status)} {ack.reason}")
    if acceptable(h, sent):
        assert ack.status == pb.Ack.STATUS_ACCEPTED, (ack, h)
        assert pending(node) == before + 1
        _drain(node, h)
    else:
        assert ack.status == pb.Ack.STATUS_REJECTED and ack.reason, (ack, h)
        assert pending(node) == before
    assert in_progress(node) == set()


def _good(**overrides) -> pb.TensorHeader:
    fields = dict(sender=1, receiver=0, kind=KIND, dtype=pb.DTYPE_FLOAT32, numel=N, payload_bytes=4 * N)
    return pb.TensorHeader(**{**fields, **overrides})


_GOOD = _good()

# Raw chunk bytes: a header, a data chunk, protobuf garbage, and arbitrary bytes.
chunks = st.one_of(
    st.builds(lambda: encode_header(_good(message_id=next(_ids)))),
    st.binary(max_size=4 * N + 8).map(encode_data),
    st.sampled_from([b"", b"\x0a", b"\x12", b"\x12\xff", b"\x12\x05ab", b"\x0a\x02\x08", b"\x08\x01", b"\xff" * 9,
                     b"\x12" + b"\xff" * 11, b"\x1a\x00", b"\x0a\x00\x12\x00"]),
    st.binary(max_size=64),
)


def _parse(raw: bytes) -> tuple[str, object]:
    """What the generated protobuf class (not framing.py) makes of one chunk."""
    try:
        chunk = pb.TensorChunk.FromString(raw)
    except Exception:  # noqa: BLE001 - DecodeError: not a TensorChunk
        return ("garbage", None)
    which = chunk.WhichOneof("payload")
    return (which, chunk.header if which == "header" else chunk.data) if which else ("empty", None)


@FUZZ
@given(stream=st.lists(chunks, max_size=6))
@example(stream=[])
@example(stream=[encode_data(bytes(4 * N))])                                            # no header
@example(stream=[encode_header(_good(message_id=next(_ids))), encode_header(_GOOD)])  # two headers
@example(stream=[encode_header(_good(message_id=next(_ids), payload_bytes=2**63))])   # huge size
@example(stream=[encode_header(_good(message_id=next(_ids))), encode_data(bytes(4 * N + 1))])
@example(stream=[encode_header(_good(message_id=next(_ids))), b"\x0a\xff\xff\xff\xff\x0f"])
def test_fuzzed_chunk_streams_are_rejected(node, stream):
    """Any stream but `one header, then exactly its bytes` is rejected with a reason."""
    before = pending(node)
    ack = node.push(iter(stream), timeout=10)
    parsed = [_parse(c) for c in stream]
    header = parsed[0][1] if parsed and parsed[0][0] == "header" else None
    valid = (header is not None and all(p[0] == "data" for p in parsed[1:])
             and acceptable(header, sum(len(p[1]) for p in parsed[1:])))
    event(f"ack {pb.Ack.Status.Name(ack.status)} {ack.reason}")
    if valid:
        assert ack.status == pb.Ack.STATUS_ACCEPTED, ack
        _drain(node, pb.TensorChunk.FromString(stream[0]).header)
    else:
        assert ack.status == pb.Ack.STATUS_REJECTED and ack.reason, (ack, stream)
        assert pending(node) == before
    assert in_progress(node) == set()


def test_oversized_chunk_gets_a_clear_status_and_node_survives(node):
    big = encode_data(bytes(CHUNK + (2 << 20)))  # over the node's message limit (chunk + 1 MiB)
    with pytest.raises(grpc.RpcError) as refused:
        node.push(iter([encode_header(_good(message_id=next(_ids))), big]), timeout=10)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    _assert_node_healthy(node)


def test_node_is_healthy_after_fuzzing(node):
    """Runs after the fuzz tests (file order): the node took all that and still works."""
    _assert_node_healthy(node)
    rejected = node.metrics.registry.get_sample_value("p2ptrain_rejected_messages_total",
                                                      {"node": "0", "reason": "malformed_chunk"})
    assert rejected and rejected > 0


# Parameter server ------------------------------------------------------------------------------
PS_WORKERS = 2
@pytest.fixture(scope="module")
def ps():
    theta0 = torch.arange(N, dtype=torch.float32)
    with ParameterServer(theta0, PS_WORKERS, listen="127.0.0.1:0", chunk_bytes=CHUNK, shutdown_grace=0.2) as server:
        channel = grpc.insecure_channel(f"127.0.0.1:{server.port}", options=grpc_options())
        server.commit_raw = channel.stream_unary(COMMIT_METHOD, request_serializer=serialize_identity,
                                                 response_deserializer=pb.CommitReply.FromString)
        server.theta0 = theta0
        yield server
        channel.close()


@settings(FUZZ, max_examples=150)
@given(h=headers(), stream_tail=st.one_of(st.just([encode_data(bytes(4 * N))]), st.lists(chunks, max_size=2)),
       garbage_first=st.sampled_from([False, False, False, True]))
def test_fuzzed_commits_never_touch_theta(ps, h, stream_tail, garbage_first):
    """Fuzzed commit headers (kind / sender / sizes / NaN) and streams: a rejecting reply and θ,
    its version and the commit count unchanged, unless the commit is a valid one."""
    if h.kind == KIND:  # the fuzzer's near-valid kind: make it the commit kind
        h.kind = pb.MESSAGE_KIND_PS_COMMIT
    h.step %= 3
    stream = [encode_header(h), *stream_tail]
    if garbage_first:
        stream.insert(0, b"\x12\xff")
    version, theta = ps.theta()
    reply = ps.commit_raw(iter(stream), timeout=10)
    valid = (not garbage_first and h.kind == pb.MESSAGE_KIND_PS_COMMIT and h.sender in (0, 1)
             and h.dtype == pb.DTYPE_FLOAT32 and h.codec == pb.CODEC_NONE and h.numel == N
             and h.payload_bytes == 4 * N and not h.codec_params
             and (not h.shape or (all(d >= 0 for d in h.shape) and math.prod(h.shape) == N))
             and 0 <= h.ps_weight <= PS_WORKERS and 0 <= h.relay_count <= PS_WORKERS
             and h.step <= version and h.commit_scaling in pb.CommitScaling.values())
    event(f"reply {pb.Ack.Status.Name(reply.ack.status)} {reply.ack.reason}")
    if reply.ack.status == pb.Ack.STATUS_ACCEPTED:  # only a valid header with exactly its bytes
        assert valid, (reply, h)
        return
    assert reply.ack.status == pb.Ack.STATUS_REJECTED and reply.ack.reason, reply
    after_version, after = ps.theta()
    assert after_version == version and torch.equal(after, theta)


def test_parameter_server_still_commits_after_fuzzing(ps):
    from p2ptrain.ps import PsClient

    with PsClient(f"127.0.0.1:{ps.port}", 1, chunk_bytes=CHUNK, timeout=10) as worker:
        theta, version = worker.pull()
        reply = worker.commit(torch.ones(N), version)
        assert reply.ack.status == pb.Ack.STATUS_ACCEPTED and reply.version == version + 1
        assert torch.equal(ps.theta()[1], theta + 1)


# The TCP lane (the same node's lane: its default data plane offers one) ----------------------------
LANE_CAP = 4 * N + 8  # payload bytes a fuzzed lane message carries at most


@FUZZ
@given(h=headers())
@example(h=pb.TensorHeader(sender=1, receiver=0, kind=KIND, dtype=pb.DTYPE_FLOAT32, numel=N, payload_bytes=2**62))
def test_fuzzed_headers_over_the_lane_are_accepted_exactly_when_valid(node, h):
    """The same headers and oracle as over gRPC: a lane connection (authenticated as the header's
    sender when that is a peer) carries the header and exactly the bytes it announces."""
    before = pending(node)
    with RawLane(node.lane_port, sender=h.sender if h.sender in (1, 2) else 1, receiver=0) as lane:
        assert lane.verdict.accepted
        if h.payload_bytes <= LANE_CAP:
            ack = lane.push(h, bytes(h.payload_bytes))
        else:  # never valid: refused at the header, before any payload byte
            lane.send(encode(h))
            ack = lane.ack()
    event(f"lane ack {pb.Ack.Status.Name(ack.status)} {ack.reason}")
    if acceptable(h, h.payload_bytes):
        assert ack.status == pb.Ack.STATUS_ACCEPTED, (ack, h)
        _drain(node, h)
    else:
        assert ack.status == pb.Ack.STATUS_REJECTED and ack.reason, (ack, h)
        assert pending(node) == before
    wait_until(lambda: in_progress(node) == set(), what="nothing half-received")


lane_bytes = st.one_of(
    st.builds(lambda: encode(_good(message_id=next(_ids)))),  # a valid header frame
    st.binary(max_size=LANE_CAP).map(lambda b: PREFIX.pack(len(b)) + b),  # a frame of anything
    st.binary(max_size=LANE_CAP),  # bytes: payload, or the middle of something
    st.sampled_from([PREFIX.pack(0), PREFIX.pack(MAX_FRAME_BYTES + 1), PREFIX.pack(2**32 - 1), b"\x00\x00",
                     PREFIX.pack(3) + b"\x08\x01\x10", bytes(4 * N)]),
)


def _replies(lane: RawLane) -> list[bytes]:
    """Every frame the node sends until it closes the connection (or goes quiet for 2 s)."""
    lane.sock.settimeout(2)
    data = b""
    try:
        while chunk := lane.sock.recv(65536):
            data += chunk
    except (TimeoutError, ConnectionError):
        pass
    frames = []
    while len(data) >= PREFIX.size:
        (length,) = PREFIX.unpack(data[:PREFIX.size])
        assert length <= MAX_FRAME_BYTES and len(data) >= PREFIX.size + length, "a reply frame is cut or too long"
        frames.append(data[PREFIX.size:PREFIX.size + length])
        data = data[PREFIX.size + length:]
    assert not data
    return frames


@FUZZ
@given(stream=st.lists(lane_bytes, max_size=6), authenticate=st.booleans())
@example(stream=[PREFIX.pack(MAX_FRAME_BYTES + 1)], authenticate=True)
@example(stream=[encode(_good(message_id=next(_ids))), bytes(4 * N - 1)], authenticate=True)  # cut short
@example(stream=[b"\xff" * 64], authenticate=False)
def test_fuzzed_lane_byte_streams_never_hurt_the_node(node, stream, authenticate):
    """Any bytes after (or instead of) the handshake, then the client closes: every reply is a
    whole Ack (or LaneAuthReply), ACCEPTED only for a valid header whose payload came whole, each
    refusal has a reason, and the node holds nothing afterwards."""
    before = pending(node)
    valid_ids = {h.message_id for h in (_parse_lane_header(part) for part in stream)
                 if h is not None and acceptable(h, h.payload_bytes)}
    lane = RawLane(node.lane_port, sender=1 if authenticate else None, receiver=0)
    try:
        try:
            lane.send(b"".join(stream))
            lane.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the node refused and closed first: its replies are still to be read
        replies = _replies(lane)
    finally:
        lane.close()
    # The node may still be reading what this connection sent (a loaded machine): the counts below
    # are its verdict once it has closed the connection, not a race with it.
    wait_until(lambda: on_loop(node, lambda: not node.lane_server.connections), what="the lane to close")
    accepted = 0
    for body in replies:
        if not authenticate:
            verdict = pb.LaneAuthReply.FromString(body)
            assert not verdict.accepted and verdict.reason, verdict
            continue
        ack = pb.Ack.FromString(body)
        event(f"lane ack {pb.Ack.Status.Name(ack.status)} {ack.reason}")
        if ack.status == pb.Ack.STATUS_ACCEPTED:
            assert ack.message_id in valid_ids, ack
            accepted += 1
        else:
            assert ack.status in (pb.Ack.STATUS_REJECTED, pb.Ack.STATUS_DUPLICATE) and ack.reason, ack
    wait_until(lambda: in_progress(node) == set(), what="nothing half-received")
    assert pending(node) == before + accepted
    for message in node.take(KIND, 10**6):
        message.release()


def _parse_lane_header(part: bytes) -> pb.TensorHeader | None:
    """The header of a part that is exactly one TensorHeader frame (as lane_bytes makes them)."""
    if len(part) < PREFIX.size or PREFIX.unpack(part[:PREFIX.size])[0] != len(part) - PREFIX.size:
        return None
    try:
        return pb.TensorHeader.FromString(part[PREFIX.size:])
    except Exception:  # noqa: BLE001 - DecodeError: not a header
        return None


def test_node_and_its_lane_are_healthy_after_lane_fuzzing(node):
    _assert_node_healthy(node)
    assert on_loop(node, lambda: node.inbox.buffered_bytes) == 0
    wait_until(lambda: on_loop(node, lambda: not node.lane_server.connections), what="every lane closed")
    with RawLane(node.lane_port, sender=2, receiver=0) as lane:
        x = torch.arange(N, dtype=torch.float32)
        h = pb.TensorHeader(sender=2, receiver=0, step=2, kind=KIND, dtype=pb.DTYPE_FLOAT32, numel=N,
                            payload_bytes=4 * N, message_id=next(_ids))
        assert lane.push(h, x.numpy().tobytes()).status == pb.Ack.STATUS_ACCEPTED
    (message,) = node.take(KIND, 2)
    assert torch.equal(message.tensor, x)
    message.release()
