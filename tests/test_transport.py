"""End-to-end tests of the transport: real gRPC servers on 127.0.0.1, one Transport (with its own
event-loop thread) per node, and a raw synchronous gRPC client that crafts hostile streams. The
Transport-level tests run on both data planes (PLANES: gRPC streaming and the TCP lane); the raw
lane client's tests are in tests/test_lane.py."""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import math
import threading
import time
from contextlib import ExitStack, contextmanager

import grpc
import pytest
import torch

from launcher.ports import free_ports
from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.metrics import NodeMetrics
from p2ptrain.transport import FailureKind, PeerError, SendFailure, Transport, TransportOptions
from p2ptrain.transport.framing import encode_data, encode_header, iter_data_chunks, tensor_bytes
from p2ptrain.transport.loop_thread import LoopThread
from p2ptrain.transport.server import PROTOCOL_VERSION, SERVICE_NAME

torch.set_num_threads(1)

pytestmark = pytest.mark.timeout(60)

KIND = pb.MESSAGE_KIND_PUSH_SUM
FAST = TransportOptions(shutdown_grace=0.2, send_timeout=20.0)
MiB = 1 << 20
PLANES = ("grpc", "tcp")  # data planes the Transport-level tests run on (tcp: the lane, required)


def on_plane(options: TransportOptions, plane: str) -> TransportOptions:
    return dataclasses.replace(options, data_plane=plane)


# -- helpers ---------------------------------------------------------------------------------------
def loopback_addresses(count: int) -> list[str]:
    return [f"127.0.0.1:{port}" for port in free_ports(count)]


@contextmanager
def nodes(world: int, ranks=None, *, options=FAST, fingerprint: str = "", peers=None):
    """Start Transports (with NodeMetrics) for `ranks` of a `world`-node cluster on loopback."""
    peers = peers or loopback_addresses(world)
    ranks = range(world) if ranks is None else ranks
    with ExitStack() as stack:
        started = {}
        for rank in ranks:
            metrics = NodeMetrics(rank, "test")
            transport = Transport(rank, world, peers, listen=peers[rank], options=options, metrics=metrics,
                                  config_fingerprint=fingerprint)
            transport.start()
            stack.callback(transport.stop)
            started[rank] = transport
        yield started


def on_loop(transport: Transport, fn, *args):
    """Run fn(*args) on the transport's event-loop thread (the inbox is owned by that thread)."""
    return transport.run_on_loop(fn, *args)


def pending(transport: Transport) -> int:
    return on_loop(transport, transport.inbox.pending)


def in_progress(transport: Transport) -> set:
    return on_loop(transport, transport.inbox.receiving)


def sample(transport: Transport, name: str, **labels) -> float | None:
    return transport.metrics.registry.get_sample_value(name, labels)


def rejections(transport: Transport) -> dict[str, float]:
    """reason -> count of the rejected-messages counter, only reasons that were counted."""
    out = {}
    for metric in transport.metrics.registry.collect():
        if metric.name == "p2ptrain_rejected_messages":
            for s in metric.samples:
                if s.name == "p2ptrain_rejected_messages_total" and s.value:
                    out[s.labels["reason"]] = s.value
    return out


def wait_until(predicate, timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


# -- chunking edge cases end to end ----------------------------------------------------------------
def _tensor(numel: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(numel)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=gen).to(dtype)
    return torch.randint(-100, 100, (numel,), generator=gen).to(dtype)


@pytest.mark.parametrize("numel, dtype, chunk_bytes, shape", [
    pytest.param(1000, torch.float32, None, None, id="smaller-than-a-chunk"),
    pytest.param(200_003, torch.float32, 64 * 1024, None, id="not-a-multiple-of-64KiB"),
    pytest.param(32 * 1024, torch.float32, 64 * 1024, None, id="exact-multiple-of-64KiB"),
    pytest.param(0, torch.float32, None, None, id="empty"),
    pytest.param(6 * MiB // 4, torch.float32, None, None, id="6MiB-default-4MiB-chunks"),
    pytest.param(6 * MiB // 4, torch.float32, 8 * MiB, None, id="6MiB-in-one-8MiB-chunk"),
    pytest.param(105, torch.int8, 4096, (3, 5, 7), id="int8-3d"),
    pytest.param(12_345, torch.bfloat16, 4096, None, id="bfloat16-odd"),
    pytest.param(777, torch.float16, 4096, (777,), id="float16"),
])
@pytest.mark.parametrize("plane", PLANES)
def test_tensor_arrives_exactly(numel, dtype, chunk_bytes, shape, plane):
    options = FAST if chunk_bytes is None else TransportOptions(chunk_bytes=chunk_bytes, shutdown_grace=0.2)
    options = on_plane(options, plane)
    tensor = _tensor(numel, dtype)
    if shape is not None:
        tensor = tensor.reshape(shape)
    nbytes = numel * tensor.element_size()
    with nodes(2, options=options) as t:
        t[1].expect(KIND, dtype, numel)
        ack = t[0].sender.send(1, tensor, kind=KIND, step=7, ps_weight=0.375, relay_count=2.0,
                        channel="c").result(30)
        assert ack.status == pb.Ack.STATUS_ACCEPTED, ack
        assert ack.bytes_received == nbytes
        messages = t[1].recv(KIND, 7, [0], channel="c", timeout=10)
        assert list(messages) == [0]
        message = messages[0]
        assert message.sender == 0 and message.step == 7 and message.kind == KIND
        assert message.ps_weight == 0.375 and message.relay_count == 2.0
        assert message.message_id == ack.message_id
        assert message.shape == tuple(tensor.shape)
        assert message.tensor.dtype == dtype and message.tensor.numel() == numel
        assert torch.equal(message.tensor.reshape(tensor.shape), tensor)
        message.release()
        assert pending(t[1]) == 0
        # bytes metrics, exactly (payload bytes only)
        sender, receiver = t[0].metrics, t[1].metrics
        assert sender.bytes_sent_total == nbytes and sender.bytes_received_total == 0
        assert receiver.bytes_received_total == nbytes and receiver.bytes_sent_total == 0
        assert sample(t[0], "p2ptrain_sent_bytes_total", node="0", peer="1") == nbytes
        assert sample(t[0], "p2ptrain_sent_messages_total", node="0", peer="1") == 1
        assert sample(t[1], "p2ptrain_received_bytes_total", node="1", peer="0") == nbytes
        assert sample(t[1], "p2ptrain_received_messages_total", node="1", peer="0") == 1
        assert sample(t[0], "p2ptrain_send_errors_total", node="0", peer="1") is None
        assert rejections(t[1]) == {} and rejections(t[0]) == {}
        lane = sample(t[0], "p2ptrain_lane_messages_total", node="0", peer="1")
        assert lane == (1 if plane == "tcp" else None)


@pytest.mark.parametrize("plane", PLANES)
def test_several_senders_steps_and_channels(plane):
    with nodes(3, options=on_plane(FAST, plane)) as t:
        t[1].expect(KIND, torch.float32, 10)
        sent = {}
        futures = []
        for sender in (0, 2):
            for step in (0, 1, 2):
                x = torch.full((10,), float(10 * sender + step))
                sent[(sender, step)] = x
                futures.append(t[sender].sender.send(1, x, kind=KIND, step=step, ps_weight=step / 4))
        for f in futures:
            assert f.result(30).status == pb.Ack.STATUS_ACCEPTED
        got = t[1].recv(KIND, 1, [0, 2], timeout=10)
        assert sorted(got) == [0, 2]
        for sender, m in got.items():
            assert torch.equal(m.tensor, sent[(sender, 1)]) and m.ps_weight == 0.25
        late = t[1].take(KIND, max_step=2)
        assert [(m.step, m.sender) for m in late] == [(0, 0), (0, 2), (2, 0), (2, 2)]
        for m in late:
            assert torch.equal(m.tensor, sent[(m.sender, m.step)])
        assert t[1].take(KIND, max_step=100) == []
        assert t[1].metrics.bytes_received_total == 6 * 40
        assert sample(t[1], "p2ptrain_received_messages_total", node="1", peer="2") == 3


def test_take_finds_nothing_without_a_trip_to_the_loop_and_still_takes_what_arrived():
    """Inbox.holds, read from the training thread, is what take() asks first: a step past
    max_step, another channel, or a box that was opened and left empty (a refused message) holds
    nothing, and take() then returns [] without calling onto the loop (it yields the GIL, so a loop
    thread that has read a message can deliver it: take() still sees what arrived in time, which an
    in-process cluster of tiny steps relies on); a delivered message is taken."""
    with nodes(2) as t:
        t[1].expect(KIND, torch.float32, 10)
        assert t[0].sender.send(1, torch.ones(10), kind=KIND, step=3).result(30).status == pb.Ack.STATUS_ACCEPTED
        nan = torch.full((10,), math.nan)
        assert t[0].sender.send(1, nan, kind=KIND, step=1).result(30).status == pb.Ack.STATUS_REJECTED
        inbox = t[1].inbox
        assert not inbox.holds(KIND, 2) and not inbox.holds(KIND, 3, "other") and not inbox.holds(KIND + 1, 9)
        assert inbox.holds(KIND, 3)
        calls = []
        real_call = t[1].loop.call
        t[1].loop.call = lambda fn, *args, **kw: calls.append(fn) or real_call(fn, *args, **kw)
        try:
            assert t[1].take(KIND, max_step=2) == [] and calls == []
            (message,) = t[1].take(KIND, max_step=3)
            assert (message.sender, message.step, len(calls)) == (0, 3, 1)
            assert not inbox.holds(KIND, 3)
        finally:
            t[1].loop.call = real_call


@pytest.mark.parametrize("plane", PLANES)
def test_gathers_on_the_training_thread_lose_nothing_while_the_loop_delivers(plane):
    """300 steps from two senders, sent without waiting for the receiver, gathered step by step
    (and take() looked at between them) while the loop thread puts the next ones in: every message
    taken exactly once with its own values."""
    steps = 300
    with nodes(3, options=on_plane(dataclasses.replace(FAST, step_window=2 * steps), plane)) as t:
        t[2].expect(KIND, torch.float32, 10)

        def send(sender):
            futures = [t[sender].sender.send(2, torch.full((10,), float(1000 * sender + step)), kind=KIND, step=step)
                       for step in range(steps)]
            return all(f.result(60).status == pb.Ack.STATUS_ACCEPTED for f in futures)

        pool = concurrent.futures.ThreadPoolExecutor(2)
        sent = [pool.submit(send, sender) for sender in (0, 1)]
        for step in range(steps):
            assert t[2].take(KIND, max_step=step - 1) == []  # (nothing of an earlier step is left)
            got = t[2].gather(KIND, step, [0, 1], deadline=30)
            assert sorted(got) == [0, 1], step
            for sender, message in got.items():
                assert torch.equal(message.tensor, torch.full((10,), float(1000 * sender + step)))
                message.release()
        assert all(future.result(60) for future in sent)
        pool.shutdown()
        assert t[2].take(KIND, max_step=steps) == [] and pending(t[2]) == 0


@pytest.mark.parametrize("plane", PLANES)
def test_second_message_for_an_occupied_slot_is_rejected(plane):
    with nodes(2, options=on_plane(FAST, plane)) as t:
        t[1].expect(KIND, torch.float32, 4)
        first = t[0].sender.send(1, torch.ones(4), kind=KIND, step=3, ps_weight=0.5).result(30)
        second = t[0].sender.send(1, torch.zeros(4), kind=KIND, step=3, ps_weight=0.5).result(30)
        assert first.status == pb.Ack.STATUS_ACCEPTED
        assert (second.status, second.reason) == (pb.Ack.STATUS_REJECTED, "duplicate_slot")
        messages = t[1].take(KIND, 3)
        assert len(messages) == 1 and torch.equal(messages[0].tensor, torch.ones(4))
        assert rejections(t[1]) == {"duplicate_slot": 1.0}
        assert sample(t[0], "p2ptrain_refused_sends_total", node="0", peer="1") == 1
        assert t[0].metrics.bytes_sent_total == 16  # only the accepted message counts


@pytest.mark.parametrize("plane", PLANES)
def test_send_waits_for_a_peer_that_starts_later(plane):
    peers = loopback_addresses(2)
    with nodes(2, [0], peers=peers, options=on_plane(FAST, plane)) as t:
        future = t[0].sender.send(1, torch.arange(5.0), kind=KIND, step=0)
        time.sleep(0.3)
        assert not future.done()
        late = Transport(1, 2, peers, listen=peers[1], options=on_plane(FAST, plane))
        late.expect(KIND, torch.float32, 5)  # before start: configures the inbox directly
        with late:
            assert future.result(20).status == pb.Ack.STATUS_ACCEPTED
            assert torch.equal(late.recv(KIND, 0, [0], timeout=5)[0].tensor, torch.arange(5.0))


def test_chunk_larger_than_receivers_message_limit_fails_the_send():
    """A sender with 8 MiB chunks against a receiver limited to 4 MiB + 1 MiB per message (gRPC
    streaming: the lane has no chunks)."""
    peers = loopback_addresses(2)
    with ExitStack() as stack:
        big = stack.enter_context(nodes(2, [0], peers=peers, options=TransportOptions(
            chunk_bytes=8 * MiB, shutdown_grace=0.2, data_plane="grpc")))
        small = stack.enter_context(nodes(2, [1], peers=peers))
        small[1].expect(KIND, torch.float32, 6 * MiB // 4)
        with pytest.raises(SendFailure) as info:
            big[0].sender.send(1, torch.ones(6 * MiB // 4), kind=KIND, step=0).result(30)
        assert info.value.kind is FailureKind.BUSY and "RESOURCE_EXHAUSTED" in info.value.detail
        assert sample(big[0], "p2ptrain_send_errors_total", node="0", peer="1") == 1
        assert big[0].metrics.bytes_sent_total == 0
        assert pending(small[1]) == 0 and small[1].metrics.bytes_received_total == 0
        wait_until(lambda: not in_progress(small[1]), what="the failed reception to be aborted")


# -- hostile input from a raw client ---------------------------------------------------------------
NUMEL = 1000
PAYLOAD = torch.arange(NUMEL, dtype=torch.float32) * 0.5
PAYLOAD_BYTES = bytes(tensor_bytes(PAYLOAD))
_ids = itertools.count(1000)


def header(**overrides) -> pb.TensorHeader:
    fields = dict(sender=0, receiver=1, step=0, kind=KIND, dtype=pb.DTYPE_FLOAT32, numel=NUMEL,
                  shape=[NUMEL], payload_bytes=4 * NUMEL, ps_weight=0.5, message_id=next(_ids))
    fields.update(overrides)
    return pb.TensorHeader(**fields)


def data_chunks(payload: bytes = PAYLOAD_BYTES, chunk: int = 1024) -> list[bytes]:
    return list(iter_data_chunks(memoryview(payload), chunk))


def good_stream(h: pb.TensorHeader | None = None) -> list[bytes]:
    return [encode_header(h or header()), *data_chunks()]


# The `receiver` and `raw` fixtures (a node and a raw PushTensor client to it) are in tests/conftest.py.


def assert_still_works(receiver: Transport, push, rejected_before: dict[str, float]) -> None:
    """A good message is accepted and delivered intact; no rejection is counted for it."""
    assert pending(receiver) == 0
    ack = push(iter(good_stream(header(step=1))), timeout=10)
    assert ack.status == pb.Ack.STATUS_ACCEPTED, ack
    assert ack.bytes_received == 4 * NUMEL
    messages = receiver.take(KIND, 1)
    assert len(messages) == 1 and messages[0].sender == 0
    assert torch.equal(messages[0].tensor, PAYLOAD)
    assert rejections(receiver) == rejected_before
    assert sample(receiver, "p2ptrain_received_messages_total", node="1", peer="0") == 1
    assert receiver.metrics.bytes_received_total == 4 * NUMEL


BAD_STREAMS = {
    # name: (chunks factory, expected reason)
    "wrong_dtype": (lambda: good_stream(header(dtype=pb.DTYPE_FLOAT16, payload_bytes=2 * NUMEL)), "bad_dtype"),
    "unknown_wire_dtype": (lambda: good_stream(header(dtype=99)), "bad_dtype"),
    "wrong_numel": (lambda: [encode_header(header(numel=NUMEL - 1, shape=[NUMEL - 1],
                                                  payload_bytes=4 * (NUMEL - 1))),
                             *data_chunks(PAYLOAD_BYTES[:-4])], "bad_size"),
    "payload_bytes_inconsistent_with_numel": (
        lambda: [encode_header(header(payload_bytes=4 * NUMEL + 4)), *data_chunks(PAYLOAD_BYTES + b"xxxx")],
        "bad_size"),
    "shape_does_not_hold_numel": (lambda: good_stream(header(shape=[10, 10])), "bad_shape"),
    "unknown_codec": (lambda: good_stream(header(codec=7)), "bad_codec"),
    "void_where_not_declared": (lambda: [encode_header(header(codec=pb.CODEC_VOID, payload_bytes=0, ps_weight=0))],
                                "bad_codec"),
    "unknown_sender": (lambda: good_stream(header(sender=99)), "unknown_sender"),
    "sender_is_receiver_itself": (lambda: good_stream(header(sender=1)), "unknown_sender"),
    "wrong_receiver": (lambda: good_stream(header(receiver=2)), "wrong_receiver"),
    "unexpected_kind": (lambda: good_stream(header(kind=pb.MESSAGE_KIND_GOSSIP)), "unexpected_kind"),
    "step_beyond_window": (lambda: good_stream(header(step=1000)), "future_step"),
    "step_just_beyond_window": (lambda: good_stream(header(step=65)), "future_step"),
    "nan_ps_weight": (lambda: good_stream(header(ps_weight=math.nan)), "bad_weight"),
    "inf_ps_weight": (lambda: good_stream(header(ps_weight=-math.inf)), "bad_weight"),
    "inf_relay_count": (lambda: good_stream(header(relay_count=math.inf)), "bad_weight"),
    "truncated": (lambda: [encode_header(header()), *data_chunks(PAYLOAD_BYTES[:-1])], "truncated"),
    "header_only": (lambda: [encode_header(header())], "truncated"),
    "overflow": (lambda: [*good_stream(), encode_data(b"\x00")], "payload_overflow"),
    "overflow_inside_one_chunk": (lambda: [encode_header(header()), encode_data(PAYLOAD_BYTES + b"++")],
                                  "payload_overflow"),
    "data_before_header": (lambda: [*data_chunks(), encode_header(header())], "missing_header"),
    "two_headers": (lambda: [encode_header(header()), encode_header(header()), *data_chunks()],
                    "unexpected_header"),
    "header_after_data": (lambda: [encode_header(header()), *data_chunks()[:1], encode_header(header())],
                          "unexpected_header"),
    "garbage_first_chunk": (lambda: [b"\xff" * 32, *good_stream()], "malformed_chunk"),
    "garbage_after_header": (lambda: [encode_header(header()), *data_chunks()[:2], b"\x12\x05abc"],
                             "malformed_chunk"),
    "empty_chunk_message": (lambda: [b"", *good_stream()], "malformed_chunk"),
    "empty_stream": (lambda: [], "empty_stream"),
}


@pytest.mark.parametrize("name", sorted(BAD_STREAMS))
def test_bad_stream_is_rejected_and_node_keeps_working(receiver, raw, name):
    make_chunks, reason = BAD_STREAMS[name]
    ack = raw(iter(make_chunks()), timeout=10)
    assert ack.status == pb.Ack.STATUS_REJECTED, ack
    assert ack.reason == reason
    assert ack.detail  # a human-readable explanation comes with the code
    assert rejections(receiver) == {reason: 1.0}
    assert pending(receiver) == 0
    assert receiver.take(KIND, 10_000) == []
    assert in_progress(receiver) == set()  # nothing half-received is left behind
    assert sample(receiver, "p2ptrain_received_messages_total", node="1", peer="0") is None
    assert receiver.metrics.bytes_received_total == 0
    assert_still_works(receiver, raw, {reason: 1.0})


VOID = dict(codec=pb.CODEC_VOID, payload_bytes=0, ps_weight=0.0)  # a header-only push-sum void notice


def test_a_void_notice_is_a_header_and_nothing_more(receiver, raw):
    """Where declared (push-sum: voidable), a CODEC_VOID header with no payload is delivered as an
    empty message of weight 0. Carrying weight, or any payload, it is refused: it moves no mass."""
    receiver.expect(KIND, torch.float32, NUMEL, voidable=True)
    assert raw(iter([encode_header(header(**VOID))]), timeout=10).status == pb.Ack.STATUS_ACCEPTED
    (notice,) = receiver.take(KIND, 0)
    assert (notice.tensor.numel(), notice.ps_weight, notice.codec) == (0, 0.0, pb.CODEC_VOID)
    for fields, chunks, reason in (({**VOID, "ps_weight": 0.5}, [], "bad_weight"),
                                   ({**VOID, "payload_bytes": 4 * NUMEL}, data_chunks(), "bad_size")):
        ack = raw(iter([encode_header(header(step=1, **fields)), *chunks]), timeout=10)
        assert (ack.status, ack.reason) == (pb.Ack.STATUS_REJECTED, reason), ack
    assert rejections(receiver) == {"bad_weight": 1.0, "bad_size": 1.0}
    assert receiver.take(KIND, 1) == [] and receiver.metrics.bytes_received_total == 0
    assert raw(iter(good_stream(header(step=2))), timeout=10).status == pb.Ack.STATUS_ACCEPTED
    assert torch.equal(receiver.take(KIND, 2)[0].tensor, PAYLOAD)


def test_stale_step_is_rejected(receiver, raw):
    receiver.membership.set_step(500)
    ack = raw(iter(good_stream(header(step=500 - 65))), timeout=10)
    assert (ack.status, ack.reason) == (pb.Ack.STATUS_REJECTED, "stale_step")
    ack = raw(iter(good_stream(header(step=500 - 64))), timeout=10)  # the window's edge is inside
    assert ack.status == pb.Ack.STATUS_ACCEPTED
    assert [m.step for m in receiver.take(KIND, 500)] == [436]
    assert rejections(receiver) == {"stale_step": 1.0}


def test_a_leavers_mass_is_taken_at_any_step(receiver, raw):
    """A LEAVE carries the leaver's whole push-sum mass: refused for its step (a chaos run's member
    had just rejoined far from the leaver's step), it would leave with the leaver. Like a state
    transfer it has no step window (Membership.accept_leave vets it instead)."""
    leave = pb.MESSAGE_KIND_LEAVE
    receiver.expect(leave, torch.float32, NUMEL)
    receiver.membership.set_step(500)
    for step in (500 - 65, 500 + 65):
        ack = raw(iter(good_stream(header(kind=leave, step=step))), timeout=10)
        assert ack.status == pb.Ack.STATUS_ACCEPTED, ack
    assert sorted(m.step for m in receiver.take(leave, 2 ** 62)) == [435, 565]
    assert rejections(receiver) == {}


def test_duplicate_message_id_is_acknowledged_not_delivered_twice(receiver, raw):
    h = header()
    first = raw(iter(good_stream(h)), timeout=10)
    assert first.status == pb.Ack.STATUS_ACCEPTED and first.message_id == h.message_id
    again = raw(iter(good_stream(h)), timeout=10)
    assert (again.status, again.reason) == (pb.Ack.STATUS_DUPLICATE, "duplicate")
    # same id at another step is still the same message
    moved = pb.TensorHeader()
    moved.CopyFrom(h)
    moved.step = 5
    assert raw(iter(good_stream(moved)), timeout=10).status == pb.Ack.STATUS_DUPLICATE
    messages = receiver.take(KIND, 10)
    assert len(messages) == 1 and torch.equal(messages[0].tensor, PAYLOAD)
    assert rejections(receiver) == {"duplicate": 2.0}
    assert sample(receiver, "p2ptrain_received_messages_total", node="1", peer="0") == 1
    # the same id from another sender is a different message
    other = pb.TensorHeader()
    other.CopyFrom(h)
    other.sender = 2
    assert raw(iter(good_stream(other)), timeout=10).status == pb.Ack.STATUS_ACCEPTED
    assert [m.sender for m in receiver.take(KIND, 10)] == [2]


def test_retry_after_truncated_stream_is_accepted(receiver, raw):
    h = header()
    truncated = raw(iter([encode_header(h), *data_chunks(PAYLOAD_BYTES[:1500])]), timeout=10)
    assert (truncated.status, truncated.reason) == (pb.Ack.STATUS_REJECTED, "truncated")
    assert pending(receiver) == 0
    retry = raw(iter(good_stream(h)), timeout=10)  # the failed message's id is not burned
    assert retry.status == pb.Ack.STATUS_ACCEPTED, retry
    messages = receiver.take(KIND, 0)
    assert len(messages) == 1 and messages[0].message_id == h.message_id
    assert torch.equal(messages[0].tensor, PAYLOAD)
    assert rejections(receiver) == {"truncated": 1.0}


def test_retry_after_rejected_header_is_accepted(receiver, raw):
    h = header(ps_weight=math.nan)
    assert raw(iter(good_stream(h)), timeout=10).reason == "bad_weight"
    h.ps_weight = 0.5
    assert raw(iter(good_stream(h)), timeout=10).status == pb.Ack.STATUS_ACCEPTED


def test_a_message_lands_in_the_destination_registered_for_it(receiver, raw):
    """receive_into (a state hand-out the receiver saw coming): that one message is written straight
    into the caller's tensor, with no pooled buffer and no copy; the next message of another step
    takes a pooled buffer as before, and a forgotten destination is not written."""
    destination = torch.zeros(NUMEL)
    receiver.receive_into(0, KIND, 0, destination.view(torch.uint8))
    assert raw(iter(good_stream(header(step=0))), timeout=10).status == pb.Ack.STATUS_ACCEPTED
    (message,) = receiver.take(KIND, 0)
    assert message.tensor.data_ptr() == destination.data_ptr() and torch.equal(destination, PAYLOAD)
    message.release()  # (the caller's memory: not given to the pool)
    assert raw(iter(good_stream(header(step=1))), timeout=10).status == pb.Ack.STATUS_ACCEPTED
    (other,) = receiver.take(KIND, 1)
    assert other.tensor.data_ptr() != destination.data_ptr() and torch.equal(other.tensor, PAYLOAD)
    forgotten = torch.zeros(NUMEL)
    receiver.receive_into(0, KIND, 2, forgotten.view(torch.uint8))
    receiver.receive_into(0, KIND, 2, None)
    assert raw(iter(good_stream(header(step=2))), timeout=10).status == pb.Ack.STATUS_ACCEPTED
    assert torch.equal(receiver.take(KIND, 2)[0].tensor, PAYLOAD) and not forgotten.any()


def test_a_destination_outlives_a_broken_stream_and_refuses_other_sizes(receiver, raw):
    """A stream that breaks off half-way into a destination leaves it registered for the retry,
    which lands there whole; a message of another size than the destination's takes a pooled
    buffer and leaves it untouched; a destination that is not a flat CPU byte tensor is refused."""
    destination = torch.zeros(NUMEL)
    receiver.receive_into(0, KIND, 0, destination.view(torch.uint8))
    h = header()
    truncated = raw(iter([encode_header(h), *data_chunks(PAYLOAD_BYTES[:1500])]), timeout=10)
    assert truncated.reason == "truncated" and pending(receiver) == 0
    assert raw(iter(good_stream(h)), timeout=10).status == pb.Ack.STATUS_ACCEPTED
    (message,) = receiver.take(KIND, 0)
    assert message.tensor.data_ptr() == destination.data_ptr() and torch.equal(destination, PAYLOAD)
    small = torch.zeros(NUMEL // 2)
    receiver.receive_into(0, KIND, 1, small.view(torch.uint8))
    assert raw(iter(good_stream(header(step=1))), timeout=10).status == pb.Ack.STATUS_ACCEPTED
    assert torch.equal(receiver.take(KIND, 1)[0].tensor, PAYLOAD) and not small.any()
    with pytest.raises(ValueError, match="contiguous 1-D uint8 CPU tensor"):
        receiver.receive_into(0, KIND, 2, torch.zeros(4))


def _blocking_stream(h: pb.TensorHeader, release: threading.Event, tail=()):
    """Header and one data chunk, then wait for `release`, then `tail`."""
    yield encode_header(h)
    yield encode_data(PAYLOAD_BYTES[:1024])
    release.wait(20)
    yield from tail


def test_same_id_while_first_stream_in_progress_is_delivered_once(receiver, raw):
    """DUPLICATE means "delivered": a copy completing while the first is still in flight is the one
    delivered (ACCEPTED), and the first, completing later, is the duplicate."""
    h = header()
    release = threading.Event()
    slow = raw.future(_blocking_stream(h, release, data_chunks(PAYLOAD_BYTES[1024:])), timeout=20)
    try:
        wait_until(lambda: (0, h.message_id) in in_progress(receiver), what="the first stream's header")
        concurrent = raw(iter(good_stream(h)), timeout=10)
        assert concurrent.status == pb.Ack.STATUS_ACCEPTED, concurrent
    finally:
        release.set()
    first = slow.result(10)
    assert (first.status, first.reason) == (pb.Ack.STATUS_DUPLICATE, "duplicate")
    messages = receiver.take(KIND, 0)
    assert len(messages) == 1 and torch.equal(messages[0].tensor, PAYLOAD)


@pytest.mark.parametrize("how", ["cancel", "iterator-raises"])
def test_client_abandoning_a_stream_delivers_nothing(receiver, raw, how):
    h = header()
    release = threading.Event()
    if how == "cancel":
        call = raw.future(_blocking_stream(h, release), timeout=20)
        wait_until(lambda: (0, h.message_id) in in_progress(receiver), what="the stream's header")
        assert call.cancel()
        with pytest.raises(grpc.FutureCancelledError):
            call.result(5)
        release.set()
    else:
        def failing():
            yield encode_header(h)
            yield encode_data(PAYLOAD_BYTES[:1024])
            wait_until(lambda: (0, h.message_id) in in_progress(receiver), what="the stream's header")
            raise RuntimeError("sender crashed mid-stream")

        with pytest.raises(grpc.RpcError) as info:
            raw(failing(), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNKNOWN
    # the server drops the half-received message; grpc may first end the stream as if half-closed,
    # but the handler waits for the cancel to show (server.wait_for_cancel): it is not counted "truncated"
    wait_until(lambda: not in_progress(receiver) and rejections(receiver), what="the reception to be aborted")
    assert rejections(receiver) == {"aborted_stream": 1.0}
    assert pending(receiver) == 0 and receiver.take(KIND, 10) == []
    retry = raw(iter(good_stream(h)), timeout=10)
    assert retry.status == pb.Ack.STATUS_ACCEPTED, retry
    assert torch.equal(receiver.take(KIND, 0)[0].tensor, PAYLOAD)


# -- Hello / wait_for_peers ------------------------------------------------------------------------
def test_compatible_peers_hello():
    with nodes(3, fingerprint="f00d") as t:
        for transport in t.values():
            transport.membership.wait_for_peers(timeout=10)
        t[2].membership.set_step(42)
        reply = t[0].membership.hello(2, timeout=5)
        assert (reply.node_id, reply.world_size, reply.step) == (2, 3, 42)
        assert reply.protocol_version == PROTOCOL_VERSION == "p2ptrain/1"
        assert reply.config_fingerprint == "f00d"
        assert reply.compatible and reply.reason == ""


def test_different_fingerprint_is_incompatible():
    peers = loopback_addresses(2)
    with nodes(2, [0], peers=peers, fingerprint="aaaa") as a, nodes(2, [1], peers=peers, fingerprint="bbbb") as b:
        for me, other, theirs, mine in ((a[0], 1, "aaaa", "bbbb"), (b[1], 0, "bbbb", "aaaa")):
            with pytest.raises(PeerError) as info:
                me.membership.wait_for_peers(timeout=5)
            message = str(info.value)
            assert f"node {other} at {peers[other]} incompatible" in message
            assert f"config fingerprint {theirs} != {mine}" in message
        reply = a[0].membership.hello(1)
        assert not reply.compatible and reply.config_fingerprint == "bbbb"


def test_empty_fingerprint_is_not_checked():
    peers = loopback_addresses(2)
    with nodes(2, [0], peers=peers, fingerprint="") as a, nodes(2, [1], peers=peers, fingerprint="beef") as b:
        a[0].membership.wait_for_peers(timeout=5)
        b[1].membership.wait_for_peers(timeout=5)


def test_different_world_size_is_incompatible():
    peers = loopback_addresses(3)
    with nodes(2, [0], peers=peers[:2]) as small, nodes(3, [1], peers=peers) as big:
        with pytest.raises(PeerError, match=rf"node 1 at {peers[1]} incompatible: world size 2 != 3"):
            small[0].membership.wait_for_peers(timeout=5)
        reply = small[0].membership.hello(1)
        assert not reply.compatible and reply.world_size == 3
        assert big[1].membership.identity.compatibility(3, PROTOCOL_VERSION, "") == ""


def test_address_answering_as_another_node():
    a, b = loopback_addresses(2)
    with nodes(2, [0], peers=[a, b]) as first, nodes(2, [0], peers=[b, a]) as impostor:
        assert impostor[0].port == int(b.rsplit(":", 1)[1])
        with pytest.raises(PeerError, match=rf"address {b} answers as node 0, expected 1"):
            first[0].membership.wait_for_peers(timeout=5)


def test_unreachable_peer_is_reported_within_the_timeout():
    peers = loopback_addresses(3)  # nothing will listen on peers[1] and peers[2]
    with nodes(3, [0], peers=peers) as t:
        started = time.monotonic()
        with pytest.raises(PeerError) as info:
            t[0].membership.wait_for_peers(timeout=2)
        elapsed = time.monotonic() - started
        message = str(info.value)
        assert f"node 1 at {peers[1]} unreachable" in message
        assert f"node 2 at {peers[2]} unreachable" in message
        assert "DEADLINE_EXCEEDED" in message
        assert 1.5 < elapsed < 6, elapsed


# -- reflection ------------------------------------------------------------------------------------
def test_a_long_gather_probes_its_silent_senders_and_ends_when_they_are_gone():
    """A wait longer than the link deadline (a collective waiting for its slowest member) probes
    the senders still missing every link deadline: a crashed one is found gone then, not after
    the whole 30 s."""
    options = dataclasses.replace(FAST, link_deadline=1.0, probe_timeout=1.0)
    with nodes(2, options=options) as started:
        started[1].stop()
        began = time.monotonic()
        assert started[0].gather(KIND, 0, [1], deadline=30.0) == {}
        assert time.monotonic() - began < 15
        assert 1 in started[0].membership.dead()


def _stop_later(transport: Transport, seconds: float, stopped: list[float]) -> threading.Thread:
    def stop() -> None:
        time.sleep(seconds)
        transport.stop()
        stopped.append(time.monotonic())
    thread = threading.Thread(target=stop)
    thread.start()
    return thread


@pytest.mark.parametrize("how", ["its lane hangs up", "our send is refused"])
def test_a_peer_whose_connect_is_refused_ends_the_wait_for_it_at_once(how):
    """Issue 27: a peer whose process is gone ends the wait for its message at once, not after the
    link deadline (10 s here, the default). How this node learns it: the lane connection the peer
    sent on closes and a connect to its address is refused (a ring hop waiting for a dead
    predecessor with nothing left to send to it), or this node's own send to it is refused."""
    plane = "tcp" if how == "its lane hangs up" else "grpc"
    options = on_plane(dataclasses.replace(FAST, link_deadline=10.0), plane)
    with nodes(2, options=options) as t:
        for rank in (0, 1):  # step 0 both ways: each has reached the other (a refused connect fails fast)
            t[rank].expect(KIND, torch.float32, 4)
            ack = t[1 - rank].sender.send(rank, torch.ones(4), kind=KIND, step=0).result(30)
            assert ack.status == pb.Ack.STATUS_ACCEPTED
            t[rank].recv(KIND, 0, [1 - rank], timeout=10)[1 - rank].release()
        stopped: list[float] = []
        stopper = _stop_later(t[1], 0.3, stopped)
        if how == "our send is refused":
            stopper.join()
            refused = t[0].sender.send(1, torch.ones(4), kind=KIND, step=1)
        began = time.monotonic()
        assert t[0].gather(KIND, 1, [1]) == {}
        ended = time.monotonic()
        stopper.join()
        assert ended - began < 10.0 - 1.0  # (the link deadline, with room for a busy machine)
        assert ended - stopped[0] < 1.0, "the wait outlived the peer by a second"
        assert 1 in t[0].membership.dead()
        if how == "our send is refused":
            with pytest.raises(PeerError):
                refused.result(10)


def test_a_live_peer_that_hangs_up_its_lane_is_still_waited_for():
    """A closed lane connection is only a hint: the peer still listens, so the wait goes on and
    its message, sent afresh, is taken; nobody is declared dead."""
    with nodes(2, options=on_plane(FAST, "tcp")) as t:
        t[0].expect(KIND, torch.float32, 4)
        assert t[1].sender.send(0, torch.ones(4), kind=KIND, step=0).result(30).status == pb.Ack.STATUS_ACCEPTED
        t[0].recv(KIND, 0, [1], timeout=10)[1].release()

        def hang_up_then_send() -> None:
            time.sleep(0.3)
            on_loop(t[1], lambda: t[1].loop.spawn(t[1].lanes.close()))
            wait_until(lambda: not on_loop(t[0], lambda: dict(t[0].lane_server.per_sender)), what="the hang-up")
            time.sleep(0.3)  # (the check ran meanwhile: something listens)
            t[1].sender.send(0, torch.full((4,), 2.0), kind=KIND, step=1).result(30)
        thread = threading.Thread(target=hang_up_then_send)
        thread.start()
        got = t[0].gather(KIND, 1, [1])
        thread.join()
        assert list(got) == [1] and torch.equal(got[1].tensor, torch.full((4,), 2.0))
        got[1].release()
        assert not t[0].membership.dead()


def test_a_gather_ends_as_soon_as_its_abandon_check_says_why():
    """`abandon` ends a wait that can no longer complete (say, a view drops a ring member), whatever
    is left of the deadline; the sender, alive, answers the probes and is not declared dead."""
    options = dataclasses.replace(FAST, link_deadline=1.0, probe_timeout=1.0)
    with nodes(2, options=options) as started:
        why: list[str] = []
        threading.Timer(1.5, why.append, ["the ring lost a member"]).start()
        began = time.monotonic()
        assert started[0].gather(KIND, 0, [1], deadline=30.0, abandon=lambda: why[0] if why else None) == {}
        assert 1.4 < time.monotonic() - began < 15
        assert not started[0].membership.dead()


def test_server_reflection_lists_the_peer_service():
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with nodes(2, [0]) as t, grpc.insecure_channel(t[0].peers[0]) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        responses = list(stub.ServerReflectionInfo(iter([request]), timeout=10))
        assert len(responses) == 1
        names = {s.name for s in responses[0].list_services_response.service}
        assert SERVICE_NAME == "p2ptrain.v1.Peer"
        assert "p2ptrain.v1.Peer" in names
        assert "grpc.reflection.v1alpha.ServerReflection" in names
        by_symbol = reflection_pb2.ServerReflectionRequest(file_containing_symbol="p2ptrain.v1.Peer")
        response = next(iter(stub.ServerReflectionInfo(iter([by_symbol]), timeout=10)))
        assert response.file_descriptor_response.file_descriptor_proto  # the .proto is served


# -- construction and API misuse -------------------------------------------------------------------
def test_bad_configuration_raises_value_error():
    peers = ["127.0.0.1:1", "127.0.0.1:2"]
    with pytest.raises(ValueError, match="need one address per node: 1 addresses for world size 2"):
        Transport(0, 2, peers[:1])
    with pytest.raises(ValueError, match=r"rank 2 outside 0\.\.1"):
        Transport(2, 2, peers)
    with pytest.raises(ValueError, match=r"rank -1 outside 0\.\.1"):
        Transport(-1, 2, peers)
    for chunk in (100, 4 * 1024 - 1, 64 * MiB + 1):
        with pytest.raises(ValueError, match=rf"chunk size {chunk} bytes outside \[4096, 67108864\]"):
            Transport(0, 2, peers, options=TransportOptions(chunk_bytes=chunk))


def test_send_to_self_or_unknown_peer_raises():
    with nodes(2, [0]) as t:
        for peer in (0, 2, -1, 99):
            with pytest.raises(ValueError, match=f"node 0 cannot send to {peer}"):
                t[0].sender.send(peer, torch.ones(3), kind=KIND, step=0)
        with pytest.raises(ValueError, match="cannot be sent"):
            t[0].sender.send(1, torch.ones(3, dtype=torch.int64), kind=KIND, step=0)


def test_unstarted_transport_refuses_io_and_stops_harmlessly():
    transport = Transport(0, 2, ["127.0.0.1:1", "127.0.0.1:2"], listen="127.0.0.1:0")
    with pytest.raises(RuntimeError, match="not started"):
        transport.sender.send(1, torch.ones(3), kind=KIND, step=0)
    transport.stop()


def test_listen_port_zero_picks_a_free_port():
    with Transport(0, 1, ["127.0.0.1:1"], listen="127.0.0.1:0", options=FAST) as transport:
        assert transport.port and transport.port > 0
        with grpc.insecure_channel(f"127.0.0.1:{transport.port}") as channel:
            grpc.channel_ready_future(channel).result(timeout=5)


def test_bind_failure_is_raised_by_start():
    peers = loopback_addresses(2)
    with nodes(2, [0], peers=peers):
        clash = Transport(0, 2, peers, listen=peers[0], options=FAST)
        # grpc raises "Failed to bind"; Transport's own check covers a port of 0 from grpc
        with pytest.raises(RuntimeError, match=rf"(could not listen on|Failed to bind to address) {peers[0]}"):
            clash.start(timeout=10)
        clash.stop()


@pytest.mark.parametrize("plane", PLANES)
def test_graceful_stop_is_prompt_and_idempotent(plane):
    peers = loopback_addresses(2)
    options = TransportOptions(data_plane=plane)  # default otherwise: 2 s shutdown grace
    a = Transport(0, 2, peers, listen=peers[0], options=options).start()
    b = Transport(1, 2, peers, listen=peers[1], options=options).start()
    try:
        b.expect(KIND, torch.float32, 3)
        assert a.sender.send(1, torch.ones(3), kind=KIND, step=0).result(10).status == pb.Ack.STATUS_ACCEPTED
        a.membership.wait_for_peers(timeout=5)
    finally:
        for transport in (a, b):
            started = time.monotonic()
            transport.stop()
            assert time.monotonic() - started < 5
            assert not transport.loop.thread.is_alive()
            started = time.monotonic()
            transport.stop()  # second stop: no-op
            assert time.monotonic() - started < 0.5
    # the ports are released: a new node can listen on them at once
    with Transport(1, 2, peers, listen=peers[1], options=dataclasses.replace(options, lane_port=b.lane_port)) as again:
        assert again.port == int(peers[1].rsplit(":", 1)[1])
        assert again.lane_port == b.lane_port


def test_readiness_barrier_waits_for_setup_and_survives_a_peer_that_already_left():
    """wait_for_peers(require_ready=True) waits until the peer's algorithm is set up, and a peer
    that announced its readiness in its own Hello counts as ready even after it has gone away
    (a fast peer may finish its whole run before we look)."""
    peers = loopback_addresses(2)
    with nodes(2, ranks=[0], peers=peers) as t:
        a = t[0]
        a.mark_ready()
        with nodes(2, ranks=[1], peers=peers) as t1:
            b = t1[1]
            with pytest.raises(PeerError, match="not ready"):
                a.membership.wait_for_peers(timeout=1.5, require_ready=True)
            b.mark_ready()
            b.membership.wait_for_peers(timeout=5, require_ready=True)  # tells `a` it is ready
        start = time.monotonic()
        a.membership.wait_for_peers(timeout=20, require_ready=True)  # b is gone, but it said it was ready
        assert time.monotonic() - start < 5


def test_a_first_push_waiting_for_a_peer_to_come_up_ends_when_it_is_declared_dead():
    """A push to a peer never reached yet waits for it to come up (nodes start in any order), up to
    the send timeout; once the peer is declared dead that wait ends at once (a ring's failed call
    fenced on such a push had waited 19 s for a crashed member)."""
    with nodes(2, options=dataclasses.replace(FAST, send_timeout=30.0)) as t:
        t[1].stop()
        on_loop(t[0], lambda: t[0].sender.greetings.reached.discard(1))  # never reached: it waits for it
        push = t[0].sender.send(1, torch.ones(4), kind=KIND, step=0, reliable=True)
        time.sleep(0.5)
        assert not push.done()
        declared = time.monotonic()
        on_loop(t[0], lambda: t[0].sender.liveness.mark_dead(1, "a test"))
        with pytest.raises(PeerError):
            push.result(20)
        assert time.monotonic() - declared < 5.0  # not the 30 s send timeout


def test_all_finite_checks_element_by_element_only_where_the_sum_is_not_finite():
    """The one-sum check: a NaN or Inf anywhere is found; finite values whose float32 sum overflows
    to Inf are still finite (looked at element by element); non-float and empty tensors pass."""
    from p2ptrain.transport.validation import all_finite

    values = torch.full((1000,), 3e38)  # each finite, their sum +Inf
    assert all_finite(values)
    for bad in (math.nan, math.inf, -math.inf):
        values[617] = bad
        assert not all_finite(values), bad
    assert all_finite(torch.arange(10)) and all_finite(torch.empty(0)) and all_finite(torch.randn(3, 4))


@pytest.mark.parametrize("plane", PLANES)
def test_transports_sharing_one_loop_exchange_tensors_and_stop_alone(plane):
    """Transport(loop=...): nodes on one LoopThread's loop (p2ptrain simulate hosts hundreds so).
    A tensor goes both ways exactly; one node stops and the loop serves the other on."""
    host = LoopThread("test-nodes", "nodes' loop")
    peers = loopback_addresses(2)
    options = on_plane(FAST, plane)
    started = [Transport(rank, 2, peers, listen=peers[rank], options=options, loop=host).start() for rank in range(2)]
    try:
        assert started[0].loop.thread is started[1].loop.thread is host.thread
        for rank, transport in enumerate(started):
            transport.expect(KIND, torch.float32, 6)
        for sender, receiver in ((0, 1), (1, 0)):
            tensor = torch.arange(6, dtype=torch.float32) + sender
            ack = started[sender].sender.send(receiver, tensor, kind=KIND, step=3).result(30)
            assert ack.status == pb.Ack.STATUS_ACCEPTED, ack
            message = started[receiver].recv(KIND, 3, [sender], timeout=10)[sender]
            assert torch.equal(message.tensor, tensor)
            message.release()
        started[0].stop()
        assert host.loop.is_running()
        assert started[1].run_on_loop(lambda: "served") == "served"
    finally:
        for transport in started:
            transport.stop()
        host.stop(lambda: asyncio.sleep(0), grace=0)
    assert not host.thread.is_alive()
