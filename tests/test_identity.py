"""Identity under mutual TLS (issue 23): with certificates from `p2ptrain pki` naming each node, a
certified node cannot speak for another. Real Transports and a real parameter server on loopback,
attacked with raw gRPC and lane clients that hold node 1's certificate and claim to be node 2:
each claim is refused (PERMISSION_DENIED, or a lane refusal), counted as `identity`, and changes
nothing; the same client as itself is accepted, relays name themselves in `via`, and a cluster
whose every node holds its own certificate trains normally."""
from __future__ import annotations

import itertools
import logging
import ssl
from contextlib import ExitStack, contextmanager
from pathlib import Path

import grpc
import pytest
import torch
from torch import nn

from launcher.ports import free_ports
from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.algorithms.sgp import SGP
from p2ptrain.metrics import NodeMetrics, PsMetrics
from p2ptrain.pki import init_ca, issue
from p2ptrain.ps.client import PsClient, PsError
from p2ptrain.ps.server import ParameterServer
from p2ptrain.settings import ConfigError, NodeConfig
from p2ptrain.topology import member_topology
from p2ptrain.train.optimizer import DecentralizedOptimizer
from p2ptrain.transport import Transport, TransportOptions
from p2ptrain.transport.framing import encode_data, encode_header, serialize_identity, tensor_bytes
from p2ptrain.transport.peer_identity import identity_check, same_run, server_problem
from p2ptrain.transport.security import Security, SecurityError
from p2ptrain.transport.server import HELLO_METHOD, PROTOCOL_VERSION, PUSH_METHOD, SETTLE_METHOD
from tests.cluster import run_cluster
from tests.rawlane import RawLane
from tests.test_transport import wait_until

torch.set_num_threads(1)
pytestmark = pytest.mark.timeout(120)

RUN = "run-23"
KIND = pb.MESSAGE_KIND_GOSSIP
N = 64
_ids = itertools.count(1 << 40)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    """A run's CA and certificates for nodes 0-3 and the parameter server, valid for 127.0.0.1."""
    folder = tmp_path_factory.mktemp("pki")
    init_ca(folder, RUN)
    for name in (0, 1, 2, 3, "ps"):
        issue(folder, name, hosts=["127.0.0.1", "localhost"])
    return folder


def security(certs: Path, name: int | str, *, mutual: bool = True) -> Security:
    stem = "ps" if name == "ps" else f"node-{name}"
    return Security(tls_cert=str(certs / f"{stem}.crt"), tls_key=str(certs / f"{stem}.key"),
                    tls_ca=str(certs / "ca.crt"), require_client_cert=mutual)


def credentials(certs: Path, name: int | str) -> grpc.ChannelCredentials:
    """What a raw client holding node `name`'s certificate and key presents."""
    stem = "ps" if name == "ps" else f"node-{name}"
    return grpc.ssl_channel_credentials((certs / "ca.crt").read_bytes(), (certs / f"{stem}.key").read_bytes(),
                                        (certs / f"{stem}.crt").read_bytes())


def lane_tls(certs: Path, name: int) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    context.load_cert_chain(certs / f"node-{name}.crt", certs / f"node-{name}.key")
    return context


@contextmanager
def nodes(certs: Path, world: int, ranks, *, mutual: bool = True, **options):
    """Transports (with NodeMetrics) for `ranks` of a `world`-node cluster, each with its own certificate."""
    peers = [f"127.0.0.1:{p}" for p in free_ports(world)]
    with ExitStack() as stack:
        started = {}
        for rank in ranks:
            opts = TransportOptions(**{"send_timeout": 10.0, "shutdown_grace": 0.2, "probe_timeout": 1.0,
                                       "security": security(certs, rank, mutual=mutual), **options})
            transport = Transport(rank, world, peers, listen=peers[rank], options=opts, metrics=NodeMetrics(rank))
            transport.expect(KIND, torch.float32, N)
            transport.start()
            stack.callback(transport.stop)
            started[rank] = transport
        yield started


def rejected(metrics, reason: str = "identity") -> float:
    labels = {"node": metrics.node, "reason": reason} if isinstance(metrics, NodeMetrics) else {"reason": reason}
    name = "p2ptrain_rejected_messages_total" if isinstance(metrics, NodeMetrics) else "p2ptrain_rejected_commits_total"
    return metrics.registry.get_sample_value(name, labels) or 0.0


def message(sender: int, receiver: int = 0, step: int = 0, **fields) -> tuple[pb.TensorHeader, bytes]:
    data = bytes(tensor_bytes(torch.full((N,), float(sender + 1))))
    header = pb.TensorHeader(sender=sender, receiver=receiver, step=step, kind=KIND, dtype=pb.DTYPE_FLOAT32,
                             numel=N, shape=[N], payload_bytes=len(data), ps_weight=0.5, message_id=next(_ids),
                             **fields)
    return header, data


class RawPeer:
    """A raw gRPC client to one node, holding node `holder`'s certificate."""

    def __init__(self, certs: Path, address: str, holder: int):
        self.channel = grpc.secure_channel(address, credentials(certs, holder))
        self.push_call = self.channel.stream_unary(PUSH_METHOD, request_serializer=serialize_identity,
                                                   response_deserializer=pb.Ack.FromString)
        self.hello_call = self.channel.unary_unary(HELLO_METHOD, request_serializer=pb.HelloRequest.SerializeToString,
                                                   response_deserializer=pb.HelloReply.FromString)
        self.settle_call = self.channel.unary_unary(SETTLE_METHOD,
                                                    request_serializer=pb.SettleRequest.SerializeToString,
                                                    response_deserializer=pb.SettleReply.FromString)

    def push(self, header: pb.TensorHeader, data: bytes):
        """The Ack, or the status code of the refused call."""
        try:
            return self.push_call(iter([encode_header(header), encode_data(data)]), timeout=10)
        except grpc.RpcError as exc:
            return exc.code()

    def hello(self, node_id: int, **fields):
        try:
            return self.hello_call(pb.HelloRequest(node_id=node_id, world_size=3, protocol_version=PROTOCOL_VERSION,
                                               **fields), timeout=10)
        except grpc.RpcError as exc:
            return exc.code()

    def settle(self, sender: int, ids: list[int]):
        try:
            return self.settle_call(pb.SettleRequest(sender=sender, message_ids=ids), timeout=10)
        except grpc.RpcError as exc:
            return exc.code()

    def close(self) -> None:
        self.channel.close()


# -- gRPC: PushTensor, Hello, Settle ---------------------------------------------------------------------------
def test_a_certified_node_cannot_push_hello_or_settle_as_another(certs, caplog):
    """Node 1's certificate, claiming to be node 2: every call is refused with PERMISSION_DENIED,
    counted, logged once, and nothing of it is applied; as node 1 the same client is accepted."""
    with nodes(certs, 3, [0]) as t:
        node = t[0]
        raw = RawPeer(certs, node.peers[0], holder=1)
        try:
            with caplog.at_level(logging.WARNING):
                forged, forged_data = message(sender=2)
                assert raw.push(forged, forged_data) == grpc.StatusCode.PERMISSION_DENIED
                assert raw.hello(2, ready=True, lane_port=4242, address="10.9.9.9:1") == \
                    grpc.StatusCode.PERMISSION_DENIED
                assert raw.settle(2, [forged.message_id]) == grpc.StatusCode.PERMISSION_DENIED
            assert rejected(node.metrics) == 3
            greetings = node.membership.greetings
            assert node.take(KIND, 2 ** 40) == []                       # no inbox entry
            assert 2 not in greetings.announced and 2 not in greetings.ready_peers  # no Hello news taken
            assert node.peers[2] != "10.9.9.9:1"
            warnings = [r.getMessage() for r in caplog.records if "claim" in r.getMessage()]
            assert len(warnings) == 1 and "node 2" in warnings[0] and "node 1" in warnings[0], warnings

            # the same holder as itself is accepted, and what it sends is delivered
            honest, data = message(sender=1)
            ack = raw.push(honest, data)
            assert isinstance(ack, pb.Ack) and ack.status == pb.Ack.STATUS_ACCEPTED, ack
            got = node.take(KIND, 2 ** 40)
            assert [(m.sender, m.tensor[0].item()) for m in got] == [(1, 2.0)]
            reply = raw.hello(1, ready=True)
            assert isinstance(reply, pb.HelloReply) and reply.compatible and reply.node_id == 0
            wait_until(lambda: 1 in greetings.announced, 5, "node 1's Hello")
            assert isinstance(raw.settle(1, [honest.message_id]), pb.SettleReply)
            assert rejected(node.metrics) == 3

            # the refused Settle voided nothing: node 2 itself delivers the message it named
            real = RawPeer(certs, node.peers[0], holder=2)
            try:
                ack = real.push(forged, forged_data)
                assert isinstance(ack, pb.Ack) and ack.status == pb.Ack.STATUS_ACCEPTED, ack
                assert [(m.sender, m.tensor[0].item()) for m in node.take(KIND, 2 ** 40)] == [(2, 3.0)]
            finally:
                real.close()
        finally:
            raw.close()


def test_a_forged_stream_still_being_written_gets_the_refusal_not_a_broken_stream(certs):
    """The refusal comes after the header, while 16 MiB are still on their way: the caller sees
    PERMISSION_DENIED (not a broken stream, which a sender would retry), and nothing arrives."""
    with nodes(certs, 3, [0]) as t:
        raw = RawPeer(certs, t[0].peers[0], holder=1)
        try:
            forged, _ = message(sender=2)
            forged.payload_bytes = 16 << 20
            chunks = [encode_header(forged), *(encode_data(bytes(1 << 20)) for _ in range(16))]
            with pytest.raises(grpc.RpcError) as refused:
                raw.push_call(iter(chunks), timeout=20)
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, refused.value
            assert rejected(t[0].metrics) == 1 and t[0].take(KIND, 2 ** 40) == []
        finally:
            raw.close()


def test_without_mutual_tls_nothing_is_checked(certs, tmp_path):
    """The same certificates without require_client_cert: identity is not in force, and the node
    behaves exactly as before (the claim is taken as it is)."""
    assert identity_check(security(certs, 0, mutual=False), 0) is None
    assert identity_check(security(certs, 0), 0) is not None
    # a certificate that is none (TLS reports it when it loads it, as it always did) names no node either
    (tmp_path / "cert.pem").write_text("not a certificate\n")
    garbage = Security(tls_cert=str(tmp_path / "cert.pem"), tls_key=str(tmp_path / "cert.pem"),
                       tls_ca=str(certs / "ca.crt"), require_client_cert=True)
    assert identity_check(garbage, 0) is None
    with nodes(certs, 3, [0], mutual=False) as t:
        raw = RawPeer(certs, t[0].peers[0], holder=1)
        try:
            forged, data = message(sender=2)
            ack = raw.push(forged, data)
            assert isinstance(ack, pb.Ack) and ack.status == pb.Ack.STATUS_ACCEPTED, ack
            assert [m.sender for m in t[0].take(KIND, 2 ** 40)] == [2]
            assert rejected(t[0].metrics) == 0
        finally:
            raw.close()


# -- the TCP lane ---------------------------------------------------------------------------------------------------
def test_a_certified_node_cannot_open_a_lane_as_another(certs):
    with nodes(certs, 3, [0], data_plane="tcp") as t:
        node = t[0]
        tls = lane_tls(certs, 1)
        with RawLane(node.lane_port, sender=2, receiver=0, tls=tls) as forged:
            assert not forged.verdict.accepted and forged.verdict.reason == "identity", forged.verdict
            assert "node 2" in forged.verdict.detail and forged.closed_by_peer()
        assert rejected(node.metrics) == 1
        with RawLane(node.lane_port, sender=1, receiver=0, tls=tls) as lane:
            assert lane.verdict.accepted, lane.verdict
            # a lane carries no relayed message: a header naming a relay is refused, nothing delivered
            relayed, data = message(sender=1, via=2)
            ack = lane.push(relayed, data)
            assert ack.status == pb.Ack.STATUS_REJECTED and ack.reason == "identity", ack
            assert node.take(KIND, 2 ** 40) == []
            honest, data = message(sender=1)
            assert lane.push(honest, data).status == pb.Ack.STATUS_ACCEPTED
        assert [m.sender for m in node.take(KIND, 2 ** 40)] == [1]
        assert rejected(node.metrics) == 2


# -- relays ---------------------------------------------------------------------------------------------------------
def test_relayed_messages_are_judged_by_their_hop(certs):
    """Node 1 reaches node 0 only through node 2 (declared route): node 2 forwards with via = 2,
    and node 0 accepts it from node 2's connection. A message naming a relay that did not send
    it, or its own sender as relay, is refused."""
    with nodes(certs, 3, [0, 1, 2], relay_routes=("1->0:2",), data_plane="grpc") as t:
        x = torch.arange(N, dtype=torch.float32)
        ack = t[1].sender.send(0, x, kind=KIND, step=0).result(30)
        assert ack.status == pb.Ack.STATUS_ACCEPTED, ack
        got = t[0].recv(KIND, 0, [1], timeout=10)[1]
        assert got.sender == 1 and torch.equal(got.tensor, x)
        got.release()
        assert t[2].forwarder.forwards == 1
        assert rejected(t[0].metrics) == rejected(t[2].metrics) == 0

        raw = RawPeer(certs, t[0].peers[0], holder=1)
        try:
            for fields in (dict(sender=3, via=2), dict(sender=1, via=1), dict(sender=2, via=2)):
                forged, data = message(step=1, **fields)
                assert raw.push(forged, data) == grpc.StatusCode.PERMISSION_DENIED, fields
            assert rejected(t[0].metrics) == 3
            assert t[0].take(KIND, 2 ** 40) == []
            # as the relay it is (node 1 passing on node 2's message): accepted
            passed_on, data = message(sender=2, step=1, via=1)
            ack = raw.push(passed_on, data)
            assert isinstance(ack, pb.Ack) and ack.status == pb.Ack.STATUS_ACCEPTED, ack
        finally:
            raw.close()


# -- the parameter server -----------------------------------------------------------------------------------------
def test_a_worker_cannot_pull_commit_or_say_done_as_another(certs):
    metrics = PsMetrics()
    server = ParameterServer(torch.zeros(N), 3, listen="127.0.0.1:0", metrics=metrics, shutdown_grace=0.2,
                             security=security(certs, "ps")).start()
    try:
        address = f"127.0.0.1:{server.port}"
        with PsClient(address, 2, security=security(certs, 1), timeout=10, retries=0) as forger:
            for call in (lambda: forger.pull(), lambda: forger.commit(torch.ones(N), 0), lambda: forger.done(1)):
                with pytest.raises(PsError) as refused:
                    call()
                assert "PERMISSION_DENIED" in str(refused.value), refused.value
        assert rejected(metrics) == 3
        version, theta = server.theta()
        stats = server.stats()
        assert version == 0 and torch.equal(theta, torch.zeros(N)) and stats["commits_per_worker"] == [0, 0, 0]
        assert stats["rejected"] == {"identity": 3}
        with PsClient(address, 1, security=security(certs, 1), timeout=10) as worker:
            worker.pull()
            reply = worker.commit(torch.ones(N), 0)
            assert reply.ack.status == pb.Ack.STATUS_ACCEPTED and reply.version == 1
            assert worker.done(1).workers_done == 1
        assert torch.equal(server.theta()[1], torch.ones(N))
    finally:
        server.stop()


def test_a_worker_does_not_commit_to_a_server_that_is_not_the_parameter_server(certs):
    """A server holding node 1's certificate (serving TLS without asking for client certificates,
    so that it starts) passes for the parameter server at the CA and host-name check: the worker
    pulls, then finds the server's certificate names node 1 and neither commits nor says Done."""
    impostor = ParameterServer(torch.zeros(N), 3, listen="127.0.0.1:0", shutdown_grace=0.2,
                               security=security(certs, 1, mutual=False)).start()
    real = ParameterServer(torch.zeros(N), 3, listen="127.0.0.1:0", shutdown_grace=0.2,
                           security=security(certs, "ps")).start()
    try:
        address = f"127.0.0.1:{impostor.port}"
        assert server_problem(security(certs, 0), f"127.0.0.1:{real.port}") is None
        assert "names p2ptrain://run-23/1" in server_problem(security(certs, 0), address)
        assert server_problem(security(certs, 0, mutual=False), address) is None  # identity not in force
        with PsClient(address, 0, security=security(certs, 0), timeout=10, retries=0) as worker:
            with pytest.raises(PsError, match="not the parameter server of run 'run-23'") as refused:
                worker.pull()
            assert refused.value.reason == "identity"
            for call in (lambda: worker.commit(torch.ones(N), 0), lambda: worker.done(1)):
                with pytest.raises(PsError, match="identity"):
                    call()
        assert impostor.stats()["commits_per_worker"] == [0, 0, 0]
        assert torch.equal(impostor.theta()[1], torch.zeros(N))
    finally:
        impostor.stop()
        real.stop()


# -- start-up -------------------------------------------------------------------------------------------------------
def test_a_node_whose_certificate_names_another_node_or_run_does_not_start(certs, tmp_path):
    peers = [f"127.0.0.1:{p}" for p in free_ports(2)]
    with pytest.raises(SecurityError, match=f"node 1, but its TLS certificate .* names p2ptrain://{RUN}/0"):
        Transport(1, 2, peers, options=TransportOptions(security=security(certs, 0)))
    with pytest.raises(SecurityError, match="parameter server, but .* names p2ptrain://run-23/1"):
        ParameterServer(torch.zeros(4), 2, security=security(certs, 1))

    def config(rank: int, cert: str, **kw) -> NodeConfig:
        return NodeConfig(rank=rank, world_size=2, peers=peers, tls_cert=str(certs / f"{cert}.crt"),
                          tls_key=str(certs / f"{cert}.key"), tls_ca=str(certs / "ca.crt"),
                          **{"tls_require_client_cert": True, **kw})

    with pytest.raises(ConfigError, match="node 1, but its TLS certificate .* names p2ptrain://run-23/0") as error:
        config(1, "node-0", run_id=RUN).validate()
    assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match="names run 'run-23', but this node's run_id is 'p2ptrain': set --run-id"):
        config(0, "node-0").validate()
    config(0, "node-0", run_id=RUN).validate()
    config(1, "node-1", run_id=f"{RUN}-restart2").validate()  # torchrun's restarts of the same run
    config(1, "node-0", run_id="x", tls_require_client_cert=False).validate()  # no mTLS: not in force
    assert same_run(RUN, RUN) and not same_run(RUN, "run-2") and not same_run(RUN, f"{RUN}-restartx")


def test_a_node_given_no_rank_takes_the_one_its_certificate_names(certs):
    """Under a rendezvous no source need give a rank (the store would hand out one in arrival order,
    which would not be the certified one): the certificate gives it."""
    def flags(cert: str, **kw) -> dict:
        return {"world_size": 4, "rendezvous": "127.0.0.1:29999", "run_id": RUN, "tls_cert": str(certs / f"{cert}.crt"),
                "tls_key": str(certs / f"{cert}.key"), "tls_ca": str(certs / "ca.crt"),
                "tls_require_client_cert": True, **kw}

    config = NodeConfig.from_sources(env={}, flags=flags("node-2"))
    assert config.rank == 2 and config.rank_given
    assert NodeConfig.from_sources(env={}, flags=flags("node-2", rank=2)).rank == 2
    with pytest.raises(ConfigError, match="this process is node 1, but"):  # a rank given is never overridden
        NodeConfig.from_sources(env={}, flags=flags("node-2", rank=1))
    plain = NodeConfig.from_sources(env={}, flags=flags("node-2", tls_require_client_cert=False))
    assert plain.rank == 0 and not plain.rank_given  # without mutual TLS: as before, the store assigns it


# -- a cluster ------------------------------------------------------------------------------------------------------
def test_an_identified_mutual_tls_cluster_trains_normally(certs):
    """Three nodes, each with its own certificate, run SGP (models start at 0, 3, 6; no gradient):
    push-sum averages them to 3 with Σ w = 3, over the TLS lanes, and nobody refused anything."""
    dim, steps = 8, 40

    def body(rank, comm):
        model = nn.Linear(dim, 1, bias=False).double()
        with torch.no_grad():
            model.weight.fill_(3.0 * rank)
        sgp = SGP(comm, member_topology("exponential", comm.world_size, comm.membership.members), overlap=1)
        opt = DecentralizedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model=model, algorithm=sgp,
                                     comm=comm)
        while opt.local_step < steps:
            loss = model(torch.ones(4, dim, dtype=torch.float64)).pow(2).mean() * 0
            opt.zero_grad()
            loss.backward()
            opt.step()
        opt.finish()
        return sgp.w, model.weight.detach().clone(), rejected(comm.transport.metrics), \
            comm.transport.metrics.registry.get_sample_value("p2ptrain_lane_messages_total",
                                                             {"node": str(rank), "peer": str((rank + 1) % 3)})

    options = lambda rank: TransportOptions(send_timeout=30.0, security=security(certs, rank))  # noqa: E731
    results = run_cluster(3, body, options_for=options, metrics=True, timeout=120)
    assert sum(w for w, *_ in results) == pytest.approx(3.0, abs=1e-9)
    for _, weight, refused, lane in results:
        assert torch.allclose(weight, torch.full_like(weight, 3.0), atol=1e-3), weight
        assert refused == 0
        assert lane and lane > 0  # (tensors went over the mTLS lanes)
