"""The token never travels (issue 23): every gRPC call carries a one-call HMAC proof of it for its
method, sender, receiver and time window (p2ptrain/transport/tokenauth.py). A stranger who diverts a
node's calls to itself (a rewritten store address) learns nothing it can use: the proof is for
one receiver, once, and the token is not in it. Raw clients against real Transports on loopback."""
from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest
import torch

from launcher.ports import free_ports
from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.metrics import NodeMetrics
from p2ptrain.ps.client import PsClient
from p2ptrain.ps.server import DONE_METHOD, ParameterServer
from p2ptrain.transport import SendFailure, Transport, TransportOptions, tokenauth
from p2ptrain.transport.framing import encode_header, serialize_identity
from p2ptrain.transport.security import Security
from p2ptrain.transport.server import HELLO_METHOD, PROTOCOL_VERSION, PUSH_METHOD, SERVICE_NAME
from p2ptrain.transport.tokenauth import (
    WINDOW_SECONDS,
    CallRefused,
    CallVerifier,
    ReplayCache,
    authorization,
)
from tests.test_relay import forwarded

TOKEN = "a-shared-secret-for-the-proof-tests"


def _refusal(verifier: CallVerifier, method: str, value: str | None, now: float | None = None) -> str | None:
    try:
        verifier.verify(method, value, now)
    except CallRefused as refused:
        return refused.reason
    return None


def test_a_proof_is_for_one_method_receiver_window_and_use():
    verifier = CallVerifier(TOKEN, "1")
    fresh = authorization(TOKEN, HELLO_METHOD, "0", "1")
    assert TOKEN not in fresh and fresh.startswith("P2P-HMAC 1 0 1 ")
    assert _refusal(verifier, HELLO_METHOD, fresh) is None
    assert _refusal(verifier, HELLO_METHOD, fresh) == "replayed"
    assert _refusal(verifier, PUSH_METHOD, authorization(TOKEN, HELLO_METHOD, "0", "1")) == "bad_mac"
    assert _refusal(verifier, HELLO_METHOD, authorization("another-token", HELLO_METHOD, "0", "1")) == "bad_mac"
    assert _refusal(verifier, HELLO_METHOD, authorization(TOKEN, HELLO_METHOD, "0", "2")) == "wrong_receiver"
    assert _refusal(verifier, HELLO_METHOD, None) == "missing"
    assert _refusal(verifier, HELLO_METHOD, f"Bearer {TOKEN}") == "malformed"
    forged = fresh.rsplit(" ", 1)[0] + " " + "0" * 64
    assert _refusal(verifier, HELLO_METHOD, forged) == "bad_mac"
    # Clocks may disagree by up to a window; two windows off is refused (docs: the clock assumption).
    now = 1_000_000 * WINDOW_SECONDS + 1.0
    for offset, reason in ((-WINDOW_SECONDS, None), (WINDOW_SECONDS, None), (-2 * WINDOW_SECONDS, "stale_window"),
                           (2 * WINDOW_SECONDS, "stale_window")):
        value = authorization(TOKEN, HELLO_METHOD, "0", "1", now=now + offset)
        assert _refusal(verifier, HELLO_METHOD, value, now) == reason


def test_the_replay_cache_is_bounded_and_forgets_old_windows():
    cache = ReplayCache(cap=3)
    for nonce in (b"a" * 16, b"b" * 16, b"c" * 16):
        cache.admit(10, nonce, 10)
    with pytest.raises(CallRefused, match="replay_cache_full"):
        cache.admit(10, b"d" * 16, 10)  # over the cap: refused, the cache does not grow
    assert cache.size == 3
    cache.admit(12, b"d" * 16, 12)  # window 10 is no longer accepted: forgotten
    assert cache.size == 1
    with pytest.raises(CallRefused, match="replayed"):
        cache.admit(12, b"d" * 16, 12)


class _Stranger:
    """A raw gRPC server at an address a node was made to believe is node 1's (a rewritten store
    entry): it keeps the metadata of every call it gets and answers none."""

    def __init__(self, address: str):
        self.captured: list[dict[str, str]] = []
        self.got_one = threading.Event()

        def any_call(request, context):
            self.captured.append(dict(context.invocation_metadata()))
            self.got_one.set()
            context.abort(grpc.StatusCode.UNAVAILABLE, "thanks")

        handler = grpc.method_handlers_generic_handler(SERVICE_NAME, {
            "Hello": grpc.unary_unary_rpc_method_handler(any_call, request_deserializer=pb.HelloRequest.FromString,
                                                         response_serializer=pb.HelloReply.SerializeToString)})
        self.server = grpc.server(futures.ThreadPoolExecutor(2))
        self.server.add_generic_rpc_handlers((handler,))
        self.server.add_insecure_port(address)
        self.server.start()

    def stop(self) -> None:
        self.server.stop(0)


def _hello(address: str, metadata, node_id: int = 1) -> grpc.StatusCode:
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(HELLO_METHOD, request_serializer=pb.HelloRequest.SerializeToString,
                                   response_deserializer=pb.HelloReply.FromString)
        try:
            call(pb.HelloRequest(node_id=node_id, world_size=3, protocol_version=PROTOCOL_VERSION), timeout=10,
                 metadata=metadata)
        except grpc.RpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK


def _push(address: str, metadata) -> grpc.StatusCode:
    header = pb.TensorHeader(sender=1, receiver=0, step=0, kind=pb.MESSAGE_KIND_GOSSIP, dtype=pb.DTYPE_FLOAT32,
                             numel=1, shape=[1], payload_bytes=4, message_id=77)
    with grpc.insecure_channel(address) as channel:
        call = channel.stream_unary(PUSH_METHOD, request_serializer=serialize_identity,
                                    response_deserializer=pb.Ack.FromString)
        try:
            call(iter([encode_header(header)]), timeout=10, metadata=metadata)
        except grpc.RpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK


def _rejected(transport: Transport) -> float:
    return transport.metrics.registry.get_sample_value(
        "p2ptrain_rejected_messages_total", {"node": str(transport.rank), "reason": "unauthenticated"}) or 0.0


def test_a_diverted_hello_teaches_a_stranger_nothing_it_can_reuse():
    """Before: node 0 sent `authorization: Bearer <token>` to whatever address the store named for
    node 1, and the stranger there reused the token on every node. Now it gets a proof that names
    node 1 as the receiver and opens no other call: node 0 and node 2 refuse it (wrong receiver),
    node 1 takes it at most once (here a stranger relays it once; the copy is refused as a replay),
    and it is no PushTensor."""
    ports = free_ports(4)
    real = [f"127.0.0.1:{p}" for p in ports[:3]]
    stranger_address = f"127.0.0.1:{ports[3]}"
    options = TransportOptions(send_timeout=5.0, shutdown_grace=0.2, probe_timeout=1.0,
                               security=Security(token=TOKEN), data_plane="grpc")
    transports = [Transport(r, 3, real, listen=real[r], metrics=NodeMetrics(r), options=options).start()
                  for r in (1, 2)]
    diverted = [real[0], stranger_address, real[2]]  # node 0 read a rewritten address/1
    node0 = Transport(0, 3, diverted, listen=real[0], metrics=NodeMetrics(0), options=options).start()
    stranger = _Stranger(stranger_address)
    try:
        with pytest.raises(SendFailure):
            node0.membership.hello(1, timeout=5)
        assert stranger.got_one.wait(10)
        proof = stranger.captured[0]["authorization"]
        assert TOKEN not in proof and proof.split(" ")[2:4] == ["0", "1"]
        captured = (("authorization", proof),)

        node1, node2 = transports
        assert _hello(real[0], captured) == grpc.StatusCode.UNAUTHENTICATED  # wrong receiver
        assert _hello(real[2], captured) == grpc.StatusCode.UNAUTHENTICATED
        assert _push(real[1], captured) == grpc.StatusCode.UNAUTHENTICATED  # a Hello's proof is no push
        assert _hello(real[1], captured) == grpc.StatusCode.OK  # relayed once, within the window...
        assert _hello(real[1], captured) == grpc.StatusCode.UNAUTHENTICATED  # ...and never again
        assert _hello(real[1], ((("authorization", f"Bearer {TOKEN}"),))) == grpc.StatusCode.UNAUTHENTICATED
        assert (_rejected(node0), _rejected(node1), _rejected(node2)) == (1, 3, 1)
        assert node1.inbox.pending() == 0

        # The honest cluster is unharmed: node 1 and node 2 greet each other and exchange a tensor.
        node2.membership.hello(1, timeout=10)
        node2.expect(pb.MESSAGE_KIND_GOSSIP, torch.float32, 4)
        x = torch.arange(4, dtype=torch.float32)
        assert node1.sender.send(2, x, kind=pb.MESSAGE_KIND_GOSSIP, step=0).result(10).status == \
            pb.Ack.STATUS_ACCEPTED
        assert torch.equal(node2.recv(pb.MESSAGE_KIND_GOSSIP, 0, [1], timeout=10)[1].tensor, x)
    finally:
        stranger.stop()
        for transport in (node0, *transports):
            transport.stop()


def test_parameter_server_calls_carry_proofs_for_ps():
    theta0 = torch.arange(4, dtype=torch.float32)
    with ParameterServer(theta0, 1, listen="127.0.0.1:0", shutdown_grace=0.2,
                         security=Security(token=TOKEN)) as server:
        address = f"127.0.0.1:{server.port}"
        with PsClient(address, 0, timeout=10, security=Security(token=TOKEN)) as worker:
            pulled, version = worker.pull()
            assert version == 0 and torch.equal(pulled, theta0)
            assert worker.commit(torch.ones(4), version).ack.status == pb.Ack.STATUS_ACCEPTED
        # A node's proof (receiver "0") is no proof for the parameter server.
        with grpc.insecure_channel(address) as channel:
            done = channel.unary_unary(DONE_METHOD,
                                       request_serializer=pb.DoneRequest.SerializeToString,
                                       response_deserializer=pb.DoneReply.FromString)
            with pytest.raises(grpc.RpcError) as refused:
                done(pb.DoneRequest(worker=0, steps=1), timeout=10,
                     metadata=Security(token=TOKEN).call_metadata(DONE_METHOD, "0", "0"))
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_relayed_push_carries_a_proof_per_hop():
    """A relay authenticates to the next hop as itself (its own proof for that hop): 0 -> 1 -> 2."""
    peers = [f"127.0.0.1:{p}" for p in free_ports(3)]
    options = TransportOptions(send_timeout=10.0, shutdown_grace=0.2, security=Security(token=TOKEN),
                               data_plane="grpc", relay_routes=["0->2:1"])
    cluster = [Transport(r, 3, peers, listen=peers[r], metrics=NodeMetrics(r), options=options).start()
               for r in range(3)]
    try:
        cluster[2].expect(pb.MESSAGE_KIND_GOSSIP, torch.float32, 4)
        x = torch.arange(4, dtype=torch.float32)
        assert cluster[0].sender.send(2, x, kind=pb.MESSAGE_KIND_GOSSIP, step=0).result(15).status == \
            pb.Ack.STATUS_ACCEPTED
        assert torch.equal(cluster[2].recv(pb.MESSAGE_KIND_GOSSIP, 0, [0], timeout=10)[0].tensor, x)
        assert [_rejected(t) for t in cluster] == [0, 0, 0]
        assert forwarded(cluster[1]) == 1  # it did go through node 1
    finally:
        for t in cluster:
            t.stop()


def test_a_call_that_waits_for_its_peer_sends_a_fresh_proof(monkeypatch):
    """A Hello made while its peer is still down waits for the channel first and makes its proof
    when it goes out: with 1 s windows it outlives the window it was started in, and is accepted."""
    monkeypatch.setattr(tokenauth, "WINDOW_SECONDS", 1)  # (both sides of this process use it)
    peers = [f"127.0.0.1:{p}" for p in free_ports(2)]
    options = TransportOptions(send_timeout=20.0, shutdown_grace=0.2, security=Security(token=TOKEN),
                               data_plane="grpc")
    node0 = Transport(0, 2, peers, listen=peers[0], options=options).start()
    node1 = None
    answered: list = []
    waiter = threading.Thread(target=lambda: answered.append(node0.membership.hello(1, timeout=20)))
    try:
        waiter.start()
        time.sleep(3.5)  # more than the ±1 window a proof made at the start would be accepted in
        node1 = Transport(1, 2, peers, listen=peers[1], metrics=NodeMetrics(1), options=options).start()
        waiter.join(30)
        assert answered and answered[0].node_id == 1
        assert _rejected(node1) == 0
    finally:
        waiter.join(30)
        for t in (node0, node1):
            if t is not None:
                t.stop()


def test_a_worker_that_waits_for_the_parameter_server_retries_with_a_fresh_proof(monkeypatch):
    monkeypatch.setattr(tokenauth, "WINDOW_SECONDS", 1)
    port = free_ports(1)[0]
    theta0 = torch.arange(4, dtype=torch.float32)
    pulled: list = []
    with PsClient(f"127.0.0.1:{port}", 0, timeout=20, security=Security(token=TOKEN)) as worker:
        waiter = threading.Thread(target=lambda: pulled.append(worker.pull()))
        waiter.start()
        time.sleep(3.5)  # the Pull's proof is stale by the time the server answers
        with ParameterServer(theta0, 1, listen=f"127.0.0.1:{port}", shutdown_grace=0.2,
                             security=Security(token=TOKEN)):
            waiter.join(30)
    assert pulled and torch.equal(pulled[0][0], theta0)
