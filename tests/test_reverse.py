"""Reverse connections (issue 25, part 2): a public node reaches a private one down the stream the
private node opened. Real Transports on loopback: node 1 listens on 127.0.0.1 while node 0 holds
127.0.0.2 for it, so node 0 cannot dial it (refused), as if it sat behind NAT.
"""
from __future__ import annotations

from contextlib import contextmanager

import grpc
import pytest
import torch

from launcher.ports import free_ports
from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.metrics import NodeMetrics
from p2ptrain.pki import init_ca, issue
from p2ptrain.transport import Transport, TransportOptions
from p2ptrain.transport.errors import SendFailure
from p2ptrain.transport.framing import encode_header
from p2ptrain.transport.paths.grpc_path import REVERSE_METHOD
from p2ptrain.transport.paths.reverse import MAX_CALLS
from p2ptrain.transport.peer_identity import certified_server
from p2ptrain.transport.security import Security, SecurityError
from p2ptrain.transport.server import PROTOCOL_VERSION
from tests.test_transport import wait_until

KIND = pb.MESSAGE_KIND_PUSH_SUM


@contextmanager
def private_pair(security=lambda rank: Security()):
    """Node 0 public, node 1 private and reaching out (its reverse stream to node 0 open);
    `security(rank)`: each node's TLS settings."""
    ports = free_ports(2)
    listen = [f"127.0.0.1:{p}" for p in ports]
    peers = [listen[0], f"127.0.0.2:{ports[1]}"]
    made = [Transport(r, 2, peers, listen=listen[r], metrics=NodeMetrics(r), options=TransportOptions(
        probe_timeout=1.0, chunk_bytes=4096, send_timeout=10.0, security=security(r))).start() for r in range(2)]
    try:
        a, b = made
        b.loop.submit(b.membership.greetings.hello(0, 10.0)).result(20)
        assert b.check_reachability() == "private"
        wait_until(lambda: 1 in a.grpc.reverse_clients, 10, "node 1's reverse stream at node 0")
        yield a, b
    finally:
        for transport in reversed(made):  # (the private node first: the public one waits for it to stop)
            transport.stop()


@pytest.fixture
def public_and_private():
    with private_pair() as pair:
        yield pair


def test_a_public_node_greets_and_sends_to_a_private_one_down_its_reverse_stream(public_and_private):
    a, b = public_and_private
    reply = a.loop.submit(a.membership.greetings.hello(1, 5.0, wait_for_ready=False)).result(20)
    assert reply.node_id == 1 and reply.reachability == pb.REACHABILITY_PRIVATE and reply.lane_port == 0
    # node 0 tells whoever greets it that node 1 is private and that it met node 1 (a private node
    # behind another NAT relays to node 1 at once, and counts it as met)
    reply = b.loop.submit(b.membership.greetings.hello(0, 5.0, wait_for_ready=False)).result(20)
    assert list(reply.private_peers) == [1] and 1 in reply.met
    b.expect(KIND, torch.float32, 10_000)  # 40 KB: ten 4 KiB chunks down the stream
    for step in range(3):
        tensor = torch.randn(10_000, generator=torch.Generator().manual_seed(step))
        ack = a.sender.send(1, tensor, kind=KIND, step=step).result(30)
        assert ack.status == pb.Ack.STATUS_ACCEPTED, ack
        assert torch.equal(b.recv(KIND, step, [0], timeout=10)[0].tensor, tensor)
    assert a.router.paths_taken() == {1: "reverse"}
    assert a.metrics.registry.get_sample_value("p2ptrain_peer_via", {"node": "0", "peer": "1"}) == -2.0


def test_a_broken_reverse_stream_fails_calls_in_flight_and_is_opened_again(public_and_private):
    a, b = public_and_private
    first = a.grpc.reverse_clients[1]
    link = b.reverse_links[0]
    opened = link.opened
    a.loop.call(first.close)  # as if the stream broke off at node 0's end
    wait_until(lambda: link.opened > opened and a.grpc.reverse_clients.get(1) not in (None, first), 15,
               "the stream opened again")
    reply = a.loop.submit(a.membership.greetings.hello(1, 5.0, wait_for_ready=False)).result(20)
    assert reply.node_id == 1


def reverse_call(address: str, *frames: pb.ReverseUp, credentials=None):
    """Open a Reverse stream to `address` with a raw client, send `frames` and read what comes down:
    (the ReverseDown frames, None) or (those before the refusal, its status code)."""
    channel = grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
    call = channel.stream_stream(REVERSE_METHOD, request_serializer=pb.ReverseUp.SerializeToString,
                                 response_deserializer=pb.ReverseDown.FromString)
    down = []
    try:
        for frame in call(iter(frames), timeout=10):
            down.append(frame)
        return down, None
    except grpc.RpcError as exc:
        return down, exc.code()
    finally:
        channel.close()


def test_a_reverse_stream_must_open_with_the_private_node_it_comes_from(public_and_private):
    """Malformed opens are refused and register nothing: no ReverseOpen first, a node that is not
    a peer, the node itself; an answer to a call never made changes nothing."""
    a, b = public_and_private
    address = a.grpc.addresses[0]
    assert reverse_call(address, pb.ReverseUp(call_id=3, hello=pb.HelloReply(node_id=1))) == \
        ([], grpc.StatusCode.INVALID_ARGUMENT)
    assert reverse_call(address) == ([], grpc.StatusCode.INVALID_ARGUMENT)  # (nothing at all)
    for node in (0, 2, 7):  # itself, and beyond the world of 2
        assert reverse_call(address, pb.ReverseUp(open=pb.ReverseOpen(node_id=node))) == \
            ([], grpc.StatusCode.INVALID_ARGUMENT), node
    assert set(a.grpc.reverse_clients) == {1}
    client = a.grpc.reverse_clients[1]
    client.answered(pb.ReverseUp(call_id=12345, ack=pb.Ack()))  # (bogus id: nothing waits for it)
    assert a.loop.submit(a.membership.greetings.hello(1, 5.0, wait_for_ready=False)).result(20).node_id == 1


def test_a_call_down_a_reverse_stream_as_another_node_is_refused(public_and_private):
    """The stream is node 0's: a Hello or Settle down it naming node 2 is answered PERMISSION_DENIED
    by the private node, and a push claiming another sender is refused by its usual checks."""
    a, b = public_and_private
    client = a.grpc.reverse_clients[1]
    with pytest.raises(SendFailure, match="down node 0's reverse stream"):
        a.loop.submit(client.hello(pb.HelloRequest(node_id=2, world_size=2, protocol_version=PROTOCOL_VERSION),
                                   5.0)).result(20)
    with pytest.raises(SendFailure, match="down node 0's reverse stream"):
        a.loop.submit(client.settle(pb.SettleRequest(sender=2, message_ids=[1]), 5.0)).result(20)
    b.expect(KIND, torch.float32, 16)
    header = pb.TensorHeader(sender=5, receiver=1, step=0, kind=KIND, dtype=pb.DTYPE_FLOAT32, numel=16, shape=[16],
                             payload_bytes=64, message_id=77)
    ack = a.loop.submit(client.push(header, memoryview(bytes(64)), 10.0)).result(20)
    assert ack.status == pb.Ack.STATUS_REJECTED, ack
    assert a.loop.submit(a.membership.greetings.hello(1, 5.0, wait_for_ready=False)).result(20).node_id == 1


def test_a_peer_that_never_ends_its_calls_down_a_stream_gets_no_more_than_max_calls(public_and_private):
    """Pushes opened and never ended hold at most MAX_CALLS slots at the private node; the next is
    answered RESOURCE_EXHAUSTED, and the stream keeps working once they are ended."""
    a, b = public_and_private
    client = a.grpc.reverse_clients[1]
    b.expect(KIND, torch.float32, 16)

    async def hold_open(count: int):
        calls = [client.open_push(10.0) for _ in range(count)]
        for i, call in enumerate(calls):
            header = pb.TensorHeader(sender=0, receiver=1, step=0, kind=KIND, dtype=pb.DTYPE_FLOAT32, numel=16,
                                     shape=[16], payload_bytes=64, message_id=1000 + i)
            await call.write(encode_header(header))
        return calls

    calls = a.loop.submit(hold_open(MAX_CALLS)).result(60)
    extra = a.loop.submit(hold_open(1)).result(20)[0]
    with pytest.raises(SendFailure, match="calls in flight"):
        a.loop.submit(extra.result()).result(20)
    for call in calls:
        a.loop.call(call.cancel)
    tensor = torch.arange(16, dtype=torch.float32)
    assert a.sender.send(1, tensor, kind=KIND, step=1).result(30).status == pb.Ack.STATUS_ACCEPTED
    assert torch.equal(b.recv(KIND, 1, [0], timeout=10)[0].tensor, tensor)


def test_under_node_identity_the_calls_down_a_reverse_stream_are_judged_as_the_peer_s(tmp_path):
    """Mutual TLS with node certificates (`p2ptrain pki`): the private node checks that the server
    it opens its stream to shows node 0's certificate, and the calls that come down it pass node
    identity as node 0's (none is refused); a server whose certificate names another node is not
    node 0 (certified_server refuses it), and a raw client holding node 0's certificate cannot open
    a stream as node 1 (PERMISSION_DENIED, counted; node 1's stream stays)."""
    init_ca(tmp_path, "run-25")
    for name in (0, 1):
        issue(tmp_path, name, hosts=["127.0.0.1", "127.0.0.2"])

    def security(rank: int) -> Security:
        return Security(tls_cert=str(tmp_path / f"node-{rank}.crt"), tls_key=str(tmp_path / f"node-{rank}.key"),
                        tls_ca=str(tmp_path / "ca.crt"), require_client_cert=True)

    with private_pair(security) as (a, b):
        b.expect(KIND, torch.float32, 1000)
        tensor = torch.randn(1000)
        assert a.sender.send(1, tensor, kind=KIND, step=0).result(30).status == pb.Ack.STATUS_ACCEPTED
        assert torch.equal(b.recv(KIND, 0, [0], timeout=10)[0].tensor, tensor)
        assert a.router.paths_taken() == {1: "reverse"}
        for node in (a, b):
            assert node.identity.refused == 0
        address = a.grpc.addresses[0]
        assert certified_server(security(1), address, 0) is not None
        with pytest.raises(SecurityError, match="is not node 1"):
            certified_server(security(1), address, 1)
        held_by_0 = grpc.ssl_channel_credentials((tmp_path / "ca.crt").read_bytes(),
                                                 (tmp_path / "node-0.key").read_bytes(),
                                                 (tmp_path / "node-0.crt").read_bytes())
        stream = a.grpc.reverse_clients[1]
        assert reverse_call(address, pb.ReverseUp(open=pb.ReverseOpen(node_id=1)), credentials=held_by_0) == \
            ([], grpc.StatusCode.PERMISSION_DENIED)
        assert a.grpc.reverse_clients[1] is stream and a.identity.refused == 1


def test_a_reset_channel_under_the_reverse_stream_opens_it_again(public_and_private):
    """When node 0 comes back from the dead, node 1 drops its channel to it (GrpcPath.reset), which
    cancels the stream running on it: the private node opens a new one on the new channel (before,
    the cancelled stream ended its keeper and node 0 could never reach node 1 again)."""
    a, b = public_and_private
    link, first = b.reverse_links[0], a.grpc.reverse_clients[1]
    opened = link.opened
    b.loop.submit(b.grpc.reset(0)).result(10)
    wait_until(lambda: link.opened > opened and a.grpc.reverse_clients.get(1) not in (None, first), 15,
               "the stream opened again on a new channel")
    assert a.loop.submit(a.membership.greetings.hello(1, 5.0, wait_for_ready=False)).result(20).node_id == 1
