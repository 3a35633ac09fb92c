"""Reverse connections (issue 25, part 2): a public node reaches a private one down the stream the
private node opened. Real Transports on loopback: node 1 listens on 127.0.0.1 while node 0 holds
127.0.0.2 for it, so node 0 cannot dial it (refused), as if it sat behind NAT.
"""
from __future__ import annotations

import pytest
import torch

from launcher.ports import free_ports
from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.metrics import NodeMetrics
from p2ptrain.transport import Transport, TransportOptions
from tests.test_transport import wait_until

KIND = pb.MESSAGE_KIND_PUSH_SUM


@pytest.fixture
def public_and_private():
    """Node 0 public, node 1 private and reaching out (its reverse stream to node 0 open)."""
    ports = free_ports(2)
    listen = [f"127.0.0.1:{p}" for p in ports]
    peers = [listen[0], f"127.0.0.2:{ports[1]}"]
    options = TransportOptions(probe_timeout=1.0, chunk_bytes=4096, send_timeout=10.0)
    made = [Transport(r, 2, peers, listen=listen[r], options=options, metrics=NodeMetrics(r)).start() for r in range(2)]
    try:
        a, b = made
        b.loop.submit(b.membership.greetings.hello(0, 10.0)).result(20)
        assert b.check_reachability() == "private"
        wait_until(lambda: 1 in a.grpc.reverse_clients, 10, "node 1's reverse stream at node 0")
        yield a, b
    finally:
        for transport in reversed(made):  # (the private node first: the public one waits for it to stop)
            transport.stop()


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
