"""Reachability detection (issue 25, part 1): real Transports on loopback ask a peer to dial them back.

A node that listens on 127.0.0.1 while its peers hold 127.0.0.2 for it is what a node behind NAT
looks like from outside: it reaches its peers, they cannot open a connection to it (refused).
"""
from __future__ import annotations

import socket
import threading
import time

import grpc
import pytest

from launcher.ports import free_ports
from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.metrics import NodeMetrics
from p2ptrain.transport import Transport, TransportOptions
from p2ptrain.transport.reachability import MIN_INTERVAL, far_first, observed_host, verdict
from p2ptrain.transport.server import DIAL_BACK_METHOD
from tests.test_transport import wait_until


def _reachability_gauge(transport: Transport) -> float | None:
    return transport.metrics.registry.get_sample_value("p2ptrain_reachability", {"node": str(transport.rank)})


def _pair(options_for=lambda rank: TransportOptions(probe_timeout=1.0), advertised_elsewhere: int | None = None):
    """Two started Transports; `advertised_elsewhere`: that rank listens on 127.0.0.1 but both hold
    127.0.0.2 for it (peers cannot dial it)."""
    ports = free_ports(2)
    peers = [f"127.0.0.1:{p}" for p in ports]
    listen = list(peers)
    if advertised_elsewhere is not None:
        peers[advertised_elsewhere] = f"127.0.0.2:{ports[advertised_elsewhere]}"
    return [Transport(r, 2, peers, listen=listen[r], options=options_for(r), metrics=NodeMetrics(r)).start()
            for r in range(2)]


@pytest.fixture
def transports(request):
    made = []
    yield made
    for transport in reversed(made):  # (a private node first: a public one waits for it to stop)
        transport.stop()


def _greet(transport: Transport, peer: int) -> None:
    transport.loop.submit(transport.membership.greetings.hello(peer, 10.0)).result(20)


def test_a_node_its_peer_can_dial_back_is_public_and_says_so_in_its_hellos(transports):
    transports += _pair()
    a, b = transports
    _greet(b, 0)  # b reached a (and a learned b's lane port from that Hello)
    assert _reachability_gauge(b) is None  # (not asked yet)
    assert b.check_reachability() == "public"
    assert b.membership.greetings.reachability == pb.REACHABILITY_PUBLIC
    assert _reachability_gauge(b) == 1.0
    _greet(b, 0)  # its next Hello says it
    assert a.membership.greetings.peer_reachability == {1: pb.REACHABILITY_PUBLIC}
    _greet(a, 1)  # and so does its answer to a's Hello
    assert a.membership.greetings.peer_reachability == {1: pb.REACHABILITY_PUBLIC}


def test_a_node_its_peer_cannot_dial_at_the_address_it_holds_is_private(transports, caplog):
    transports += _pair(advertised_elsewhere=1)
    a, b = transports
    _greet(b, 0)
    with caplog.at_level("WARNING"):
        assert b.check_reachability() == "private"
    assert _reachability_gauge(b) == 2.0
    assert f"could not dial {a.peers[1]}" in caplog.text and "could not open the lane" in caplog.text
    _greet(b, 0)
    assert a.membership.greetings.peer_reachability == {1: pb.REACHABILITY_PRIVATE}


def test_a_forced_reachability_is_said_without_asking(transports):
    transports += _pair(lambda rank: TransportOptions(probe_timeout=1.0, reachability="private" if rank else "auto"))
    a, b = transports
    assert b.check_reachability() == "private"  # (it reached nobody: asking was impossible anyway)
    _greet(b, 0)
    assert a.membership.greetings.peer_reachability == {1: pb.REACHABILITY_PRIVATE}
    _greet(a, 1)
    assert a.check_reachability() == "unknown"  # its only peer is private: nobody to dial it back


def test_nobody_reached_leaves_reachability_unknown(transports):
    transports += _pair()
    assert transports[1].check_reachability() == "unknown"


def test_dial_back_only_dials_what_the_helper_holds_and_checks_the_incarnation(transports):
    """A stranger's DialBack names a rank the helper holds no address for: nothing is dialled. One
    naming node 1 with another incarnation: the helper dials node 1, which answers as itself but
    from another incarnation, so it is not the asker."""
    transports += _pair()
    a, b = transports
    with grpc.insecure_channel(a.peers[0]) as channel:
        dial_back = channel.unary_unary(DIAL_BACK_METHOD, request_serializer=pb.DialBackRequest.SerializeToString,
                                        response_deserializer=pb.DialBackReply.FromString)
        reply = dial_back(pb.DialBackRequest(node_id=7, incarnation=1), timeout=10)
        assert not reply.grpc_ok and "holds no address for node 7" in reply.detail
        reply = dial_back(pb.DialBackRequest(node_id=1, incarnation=b.membership.greetings.incarnation + 1),
                          timeout=10)
        assert not reply.grpc_ok and "reached another process" in reply.detail
        time.sleep(MIN_INTERVAL)  # (node 1 was just dialled)
        reply = dial_back(pb.DialBackRequest(node_id=1, incarnation=b.membership.greetings.incarnation), timeout=10)
        assert reply.grpc_ok, reply.detail
        # a flood dials node 1 once a second at most: the same incarnation gets the same answer,
        # another one is refused as too soon (the asker counts it as not answered, not as private)
        again = dial_back(pb.DialBackRequest(node_id=1, incarnation=b.membership.greetings.incarnation), timeout=10)
        assert again == reply
        with pytest.raises(grpc.RpcError) as refused:
            dial_back(pb.DialBackRequest(node_id=1, incarnation=5), timeout=10)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_the_verdict_is_public_only_if_every_helper_got_through_on_grpc_and_the_lane_it_tried():
    through = pb.DialBackReply(grpc_ok=True, lane_checked=True, lane_ok=True)
    no_lane = pb.DialBackReply(grpc_ok=True)  # the asker offers no lane
    lane_blocked = pb.DialBackReply(grpc_ok=True, lane_checked=True, lane_ok=False)
    refused = pb.DialBackReply(detail="refused")
    assert verdict([]) == pb.REACHABILITY_UNKNOWN
    assert verdict([through, no_lane]) == pb.REACHABILITY_PUBLIC
    assert verdict([refused, through]) == pb.REACHABILITY_PRIVATE  # (through: a helper on its own LAN)
    assert verdict([lane_blocked]) == pb.REACHABILITY_PRIVATE
    assert verdict([refused, refused]) == pb.REACHABILITY_PRIVATE
    natted = pb.DialBackReply(grpc_ok=True, lane_checked=True, lane_ok=True, observed="10.1.2.253")
    assert verdict([through, natted], own_host="192.168.1.2") == pb.REACHABILITY_PRIVATE  # (a NAT rewrote it)
    assert verdict([natted], own_host="10.1.2.253") == pb.REACHABILITY_PUBLIC
    assert verdict([natted], own_host="node0.example") == pb.REACHABILITY_PUBLIC  # (a host name says nothing)


def test_helpers_outside_the_own_subnet_are_asked_first_and_observed_hosts_are_parsed():
    addresses = ["10.0.0.1:1", "10.0.0.2:1", "192.168.1.2:1", "192.168.1.3:1", "192.168.1.4:1", "node5:1"]
    assert far_first([0, 1, 3, 4, 5], addresses, rank=2, world_size=6) == [5, 0, 1, 3, 4]
    assert observed_host("ipv4:10.1.2.3:5123") == "10.1.2.3"
    assert observed_host("ipv6:[::1]:5123") == "::1"
    assert observed_host("unix:/tmp/sock") == ""


def test_a_node_finds_its_reachability_at_start():
    """Through the public API: two nodes started with p2ptrain's Node report public."""
    from p2ptrain.node import Node
    from p2ptrain.settings import NodeConfig

    peers = [f"127.0.0.1:{p}" for p in free_ports(2)]
    nodes = [Node(NodeConfig(rank=r, world_size=2, peers=peers, peer_timeout=30.0)) for r in range(2)]

    threads = [threading.Thread(target=node.start) for node in nodes]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        wait_until(lambda: all(node.reachability != "unknown" for node in nodes), 30, "verdicts")
        assert [node.reachability for node in nodes] == ["public", "public"]
        assert [node.summary()["reachability"] for node in nodes] == ["public", "public"]  # (node<rank>.json)
        assert [node.summary()["paths"] for node in nodes] == [{}, {}]  # (nothing sent yet)
    finally:
        for node in nodes:
            node.stop()


def test_a_helper_whose_call_is_cancelled_under_the_ask_counts_as_no_answer():
    """A helper that comes back from the dead while a joiner asks it has its channel reset, which
    cancels the call: that is no answer, not a crash of the joiner's start-up (found by a chaos run)."""
    import asyncio

    from p2ptrain.transport.reachability import ask

    class Client:
        def __init__(self, peer):
            self.peer = peer

        async def dial_back(self, request, timeout):
            if self.peer == 1:
                raise asyncio.CancelledError()
            return pb.DialBackReply(grpc_ok=True, observed="127.0.0.1")

    class Grpc:
        addresses = ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]

        def client(self, peer):
            return Client(peer)

    found, notes = asyncio.run(ask(Grpc(), [1, 2], 0, 1, 5.0))
    assert found == pb.REACHABILITY_PUBLIC and notes == ["node 1 did not answer: "]


def test_a_peer_that_answers_others_but_not_this_node_is_reached_indirectly_and_not_declared_dead(transports):
    """SWIM's indirect probe (meeting neighbours): node 0 holds for node 2 an address where a socket
    accepts connections but never answers (a half-open path), so its own probe times out; node 1,
    asked to probe node 2 itself, reaches it, and node 2 stays alive at node 0. Without helpers
    the same probe declares it dead."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    try:
        real = [f"127.0.0.1:{port}" for port in free_ports(3)]
        options = TransportOptions(probe_timeout=1.0, meet="neighbours", reachability="public")
        for rank in range(3):
            peers = list(real)
            if rank == 0:
                peers[2] = f"127.0.0.1:{silent.getsockname()[1]}"
            transports.append(Transport(rank, 3, peers, listen=real[rank], options=options,
                                        metrics=NodeMetrics(rank)).start())
        for transport in transports:
            transport.mark_ready()
        a = transports[0]
        _greet(a, 1)  # (both ready: node 1 may be asked)
        greetings = a.membership.greetings
        assert greetings.indirect_probes == 2
        assert a.loop.submit(greetings.probe(2)).result(30) is True
        assert 2 not in a.membership.dead()
        greetings.indirect_probes = 0
        assert a.loop.submit(greetings.probe(2)).result(30) is False
        assert 2 in a.membership.dead()
    finally:
        silent.close()


def test_an_indirect_probe_request_for_the_caller_itself_or_an_unknown_rank_greets_nobody(transports):
    transports += _pair(lambda rank: TransportOptions(probe_timeout=1.0, meet="neighbours", reachability="public"))
    greetings = transports[1].membership.greetings
    run = transports[1].loop.submit
    assert run(greetings.probe_for(0, 0)).result(10) is False   # (the caller)
    assert run(greetings.probe_for(0, 1)).result(10) is False   # (itself)
    assert run(greetings.probe_for(0, 7)).result(10) is False   # (no such rank)
    assert run(greetings.probe_for(1, 0)).result(10) is True    # (a live peer, for another caller)
