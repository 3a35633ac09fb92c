"""TLS + shared-secret token on real gRPC servers on loopback: nodes (Transport) and the parameter
server. Certificates are made at test time with the openssl CLI: a CA with a server cert for
127.0.0.1 / localhost, and a second, unrelated CA that must not be trusted."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import grpc
import pytest
import torch

from launcher.ports import free_ports
from p2ptrain import cli
from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.metrics import NodeMetrics, PsMetrics
from p2ptrain.ps.client import PsClient, PsError
from p2ptrain.ps.server import ParameterServer
from p2ptrain.settings import ConfigError, NodeConfig
from p2ptrain.transport import FailureKind, SendFailure, Transport, TransportOptions
from p2ptrain.transport.paths.grpc_path import HELLO_METHOD
from p2ptrain.transport.security import Security, SecurityError, security_from_settings
from p2ptrain.transport.server import PROTOCOL_VERSION
from tests.rawlane import RawLane
from tests.test_transport import PLANES, header

TOKEN = "s3cret-token-for-tests"
KIND = pb.MESSAGE_KIND_GOSSIP
N = 1000


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _make_ca(d: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN={name}", cwd=d)


def _make_leaf(d: Path, ca: str, name: str, san: str) -> None:
    (d / f"{name}.ext").write_text(f"subjectAltName={san}\nbasicConstraints=CA:FALSE\n"
                                   "extendedKeyUsage=serverAuth,clientAuth\n")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
             f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is needed to make test certificates")
    d = tmp_path_factory.mktemp("pki")
    _make_ca(d, "ca")
    _make_leaf(d, "ca", "node", "IP:127.0.0.1,DNS:localhost")
    _make_leaf(d, "ca", "other-name", "DNS:p2ptrain.internal")  # valid cert, but not for 127.0.0.1
    _make_ca(d, "rogue-ca")
    _make_leaf(d, "rogue-ca", "rogue", "IP:127.0.0.1,DNS:localhost")
    return d


def _sec(pki: Path, token: str | None = TOKEN, *, leaf: str = "node", ca: str = "ca", **kw) -> Security:
    return Security(tls_cert=str(pki / f"{leaf}.pem"), tls_key=str(pki / f"{leaf}.key"),
                    tls_ca=str(pki / f"{ca}.pem"), token=token, **kw)


def _transport(rank: int, peers: list[str], security: Security, metrics=None, listen: str | None = None,
               plane: str = "auto"):
    options = TransportOptions(send_timeout=5.0, shutdown_grace=0.2, security=security, data_plane=plane)
    t = Transport(rank, len(peers), peers, listen=listen or peers[rank], options=options, metrics=metrics)
    t.expect(KIND, torch.float32, N)
    return t.start()


def _rejected(metrics: NodeMetrics, reason: str) -> float:
    return metrics.registry.get_sample_value("p2ptrain_rejected_messages_total",
                                             {"node": metrics.node, "reason": reason}) or 0.0


def _hello(address: str, credentials: grpc.ChannelCredentials | None, token: str | None, options=()):
    """One raw Hello to node 0 as node 1, failing fast (no wait_for_ready): returns the status code."""
    channel = (grpc.secure_channel(address, credentials, options=list(options)) if credentials
               else grpc.insecure_channel(address))
    try:
        call = channel.unary_unary(HELLO_METHOD, request_serializer=pb.HelloRequest.SerializeToString,
                                   response_deserializer=pb.HelloReply.FromString)
        call(pb.HelloRequest(node_id=1, world_size=2, protocol_version=PROTOCOL_VERSION), timeout=5,
             metadata=Security(token=token).call_metadata(HELLO_METHOD, "1", "0") if token else None)
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc.code()
    finally:
        channel.close()


@pytest.mark.parametrize("plane", PLANES)
def test_tls_token_cluster_exchanges_tensor_and_strangers_are_refused(pki, plane):
    """A TLS + token pair of nodes exchanges a tensor (over the TLS lane with plane tcp); callers
    without the token, with a wrong one, trusting another CA, or speaking plaintext are refused,
    deliver nothing, and the node keeps serving its real peer."""
    peers = [f"127.0.0.1:{p}" for p in free_ports(2)]
    metrics = NodeMetrics(0)
    node0 = _transport(0, peers, _sec(pki), metrics, plane=plane)
    node1 = _transport(1, peers, _sec(pki), NodeMetrics(1), plane=plane)
    intruders = []
    try:
        node1.membership.wait_for_peers(10)
        x = torch.arange(N, dtype=torch.float32)
        assert node1.sender.send(0, x, kind=KIND, step=0).result(10).status == pb.Ack.STATUS_ACCEPTED
        got = node0.recv(KIND, 0, [1], timeout=10)[1]
        assert torch.equal(got.tensor, x)
        got.release()
        lane = node1.metrics.registry.get_sample_value("p2ptrain_lane_messages_total", {"node": "1", "peer": "0"})
        assert lane == (1 if plane == "tcp" else None)

        # Strangers that claim to be node 1: TLS that trusts the CA, but no token / a wrong token.
        for token in (None, "wrong-token"):
            stranger = _transport(1, [peers[0], f"127.0.0.1:{free_ports(1)[0]}"], _sec(pki, token), plane=plane)
            intruders.append(stranger)
            with pytest.raises(SendFailure) as refused:
                stranger.sender.send(0, torch.full((N,), 666.0), kind=KIND, step=0).result(10)
            assert refused.value.kind is FailureKind.DENIED, refused.value
            assert TOKEN not in str(refused.value)  # the secret is never echoed
            if token:
                assert token not in str(refused.value)
        assert _rejected(metrics, "unauthenticated") == 2

        ca = (pki / "ca.pem").read_bytes()
        rogue_ca = (pki / "rogue-ca.pem").read_bytes()
        assert _hello(peers[0], grpc.ssl_channel_credentials(ca), TOKEN) == grpc.StatusCode.OK
        assert _hello(peers[0], grpc.ssl_channel_credentials(ca), None) == grpc.StatusCode.UNAUTHENTICATED
        # Wrong certificate: the client trusts another CA, so the handshake fails before any RPC.
        assert _hello(peers[0], grpc.ssl_channel_credentials(rogue_ca), TOKEN) == grpc.StatusCode.UNAVAILABLE
        assert _hello(peers[0], None, TOKEN) == grpc.StatusCode.UNAVAILABLE  # plaintext against TLS

        # A server presenting a rogue-CA certificate is not trusted by a real node either.
        rogue_port = free_ports(1)[0]
        rogue = _transport(0, [f"127.0.0.1:{rogue_port}", peers[1]], _sec(pki, leaf="rogue", ca="rogue-ca"))
        intruders.append(rogue)
        victim = _transport(1, [f"127.0.0.1:{rogue_port}", f"127.0.0.1:{free_ports(1)[0]}"], _sec(pki))
        intruders.append(victim)
        with pytest.raises(SendFailure):  # the handshake fails: times out waiting for it
            victim.membership.hello(0, timeout=2)

        assert node0.inbox.pending() == 0  # nothing of the strangers arrived
        y = torch.linspace(-1, 1, N)
        assert node1.sender.send(0, y, kind=KIND, step=1).result(10).status == pb.Ack.STATUS_ACCEPTED
        got = node0.recv(KIND, 1, [1], timeout=10)[1]
        assert torch.equal(got.tensor, y)
        got.release()
    finally:
        for t in (*intruders, node1, node0):
            t.stop()


def test_reflection_requires_the_token(pki):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    peers = [f"127.0.0.1:{p}" for p in free_ports(2)]
    node = _transport(0, peers, _sec(pki))
    channel = grpc.secure_channel(peers[0], grpc.ssl_channel_credentials((pki / "ca.pem").read_bytes()))
    try:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.ServerReflectionInfo(iter([request]), timeout=5))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        method = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
        with pytest.raises(grpc.RpcError) as refused:  # the token itself is no longer accepted
            list(stub.ServerReflectionInfo(iter([request]), timeout=5,
                                           metadata=(("authorization", f"Bearer {TOKEN}"),)))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        replies = list(stub.ServerReflectionInfo(iter([request]), timeout=5,
                                                 metadata=Security(token=TOKEN).call_metadata(method, "cli", "0")))
        names = {s.name for s in replies[0].list_services_response.service}
        assert "p2ptrain.v1.Peer" in names
    finally:
        channel.close()
        node.stop()


def test_mutual_tls_and_server_name_override(pki):
    """With --tls-require-client-cert a client without a certificate fails the handshake; a cert
    whose SAN does not match the address works only with the server-name override."""
    peers = [f"127.0.0.1:{p}" for p in free_ports(2)]
    node = _transport(0, peers, _sec(pki, None, require_client_cert=True))
    other = None
    try:
        ca = (pki / "ca.pem").read_bytes()
        client_pair = dict(private_key=(pki / "node.key").read_bytes(),
                           certificate_chain=(pki / "node.pem").read_bytes())
        assert _hello(peers[0], grpc.ssl_channel_credentials(ca), None) == grpc.StatusCode.UNAVAILABLE
        assert _hello(peers[0], grpc.ssl_channel_credentials(ca, **client_pair), None) == grpc.StatusCode.OK
        rogue_pair = dict(private_key=(pki / "rogue.key").read_bytes(),
                          certificate_chain=(pki / "rogue.pem").read_bytes())
        assert _hello(peers[0], grpc.ssl_channel_credentials(ca, **rogue_pair), None) == grpc.StatusCode.UNAVAILABLE

        other_peers = [f"127.0.0.1:{p}" for p in free_ports(2)]
        other = _transport(0, other_peers, _sec(pki, None, leaf="other-name"))
        creds = grpc.ssl_channel_credentials(ca)
        assert _hello(other_peers[0], creds, None) == grpc.StatusCode.UNAVAILABLE  # SAN is not 127.0.0.1
        override = [("grpc.ssl_target_name_override", "p2ptrain.internal")]
        assert _hello(other_peers[0], creds, None, override) == grpc.StatusCode.OK
        assert ("grpc.ssl_target_name_override", "p2ptrain.internal") in \
            _sec(pki, tls_server_name="p2ptrain.internal").channel_options([])
    finally:
        node.stop()
        if other is not None:
            other.stop()


# The TCP lane under TLS ------------------------------------------------------------------------
def _client_tls(pki: Path, ca: str = "ca", leaf: str | None = None):
    import ssl

    context = ssl.create_default_context(cafile=str(pki / f"{ca}.pem"))
    if leaf is not None:
        context.load_cert_chain(str(pki / f"{leaf}.pem"), str(pki / f"{leaf}.key"))
    return context


def _lane_message() -> tuple[pb.TensorHeader, bytes]:
    x = torch.arange(N, dtype=torch.float32)
    return header(sender=1, receiver=0, kind=KIND, numel=N, shape=[N], payload_bytes=4 * N), x.numpy().tobytes()


def test_tls_lane_takes_tls_clients_with_the_token_and_refuses_the_rest(pki):
    import socket
    import ssl

    from p2ptrain.transport.laneframes import LANE_PROTOCOL, encode

    peers = [f"127.0.0.1:{p}" for p in free_ports(3)]
    metrics = NodeMetrics(0)
    node = _transport(0, peers, _sec(pki), metrics)
    try:
        h, payload = _lane_message()
        with RawLane(node.lane_port, sender=1, receiver=0, token=TOKEN, tls=_client_tls(pki)) as friend:
            assert friend.verdict.accepted
            assert friend.push(h, payload).status == pb.Ack.STATUS_ACCEPTED
        # plaintext against the TLS lane: the TLS handshake fails, no challenge is ever sent, nothing lands
        with socket.create_connection(("127.0.0.1", node.lane_port), timeout=10) as plain:
            plain.sendall(encode(pb.LaneAuth(protocol_version=LANE_PROTOCOL, sender=1, receiver=0)) + bytes(300))
            answered = b""
            while chunk := plain.recv(4096):  # until the node closes the connection
                answered += chunk
            assert LANE_PROTOCOL.encode() not in answered
        with pytest.raises(ssl.SSLError):  # a client that trusts another CA refuses the server
            RawLane(node.lane_port, sender=1, receiver=0, token=TOKEN, tls=_client_tls(pki, "rogue-ca"))
        with RawLane(node.lane_port, sender=1, receiver=0, token="wrong", tls=_client_tls(pki)) as stranger:
            assert not stranger.verdict.accepted and stranger.verdict.reason == "unauthenticated"
        assert node.inbox.pending() == 1 and _rejected(metrics, "unauthenticated") == 1
    finally:
        node.stop()


def test_mutual_tls_lane_needs_a_client_certificate(pki):
    import ssl

    peers = [f"127.0.0.1:{p}" for p in free_ports(2)]
    node = _transport(0, peers, _sec(pki, None, require_client_cert=True), plane="tcp")
    try:
        with pytest.raises((ssl.SSLError, ConnectionError)):  # refused in the handshake, or right after it
            RawLane(node.lane_port, sender=1, receiver=0, tls=_client_tls(pki))
        with pytest.raises((ssl.SSLError, ConnectionError)):
            RawLane(node.lane_port, sender=1, receiver=0, tls=_client_tls(pki, leaf="rogue"))
        h, payload = _lane_message()
        with RawLane(node.lane_port, sender=1, receiver=0, tls=_client_tls(pki, leaf="node")) as friend:
            assert friend.push(h, payload).status == pb.Ack.STATUS_ACCEPTED
        client = _transport(1, peers, _sec(pki, None, require_client_cert=True), plane="tcp")
        try:  # and a node's own lane client offers its certificate
            x = torch.linspace(0, 1, N)
            assert client.sender.send(0, x, kind=KIND, step=1).result(10).status == pb.Ack.STATUS_ACCEPTED
            assert torch.equal(node.recv(KIND, 1, [1], timeout=5)[1].tensor, x)
        finally:
            client.stop()
    finally:
        node.stop()


def test_parameter_server_refuses_commits_without_the_token(pki):
    metrics = PsMetrics()
    theta0 = torch.arange(8, dtype=torch.float32)
    with ParameterServer(theta0, 2, listen="127.0.0.1:0", metrics=metrics, shutdown_grace=0.2,
                         security=_sec(pki)) as server:
        address = f"127.0.0.1:{server.port}"
        worker_tls = Security(tls_ca=str(pki / "ca.pem"), token=TOKEN)  # a worker needs no certificate
        for bad in (Security(tls_ca=str(pki / "ca.pem")), Security(tls_ca=str(pki / "ca.pem"), token="nope")):
            with PsClient(address, 0, timeout=5, security=bad) as stranger:
                with pytest.raises(PsError) as refused:
                    stranger.commit(torch.ones(8), 0)
                assert refused.value.reason == "UNAUTHENTICATED"
                with pytest.raises(PsError) as refused:
                    stranger.pull()
                assert refused.value.reason == "UNAUTHENTICATED"
        with PsClient(address, 0, timeout=2, retries=0, security=Security(tls_ca=str(pki / "rogue-ca.pem"),
                                                                          token=TOKEN)) as wrong_ca:
            with pytest.raises(PsError):
                wrong_ca.commit(torch.ones(8), 0)
        version, theta = server.theta()
        assert version == 0 and torch.equal(theta, theta0)  # θ untouched by the strangers
        assert metrics.registry.get_sample_value("p2ptrain_rejected_commits_total",
                                                 {"reason": "unauthenticated"}) == 4
        with PsClient(address, 1, timeout=5, security=worker_tls) as worker:
            pulled, base = worker.pull()
            assert base == 0 and torch.equal(pulled, theta0)
            reply = worker.commit(torch.ones(8), base)
            assert reply.ack.status == pb.Ack.STATUS_ACCEPTED and reply.version == 1
        version, theta = server.theta()
        assert version == 1 and torch.equal(theta, theta0 + 1)


# Settings ------------------------------------------------------------------------------------
def _files(pki: Path) -> dict:
    return {"tls_cert": str(pki / "node.pem"), "tls_key": str(pki / "node.key"), "tls_ca": str(pki / "ca.pem")}


def test_security_settings_from_flags_toml_env_and_redaction(pki, tmp_path):
    parser = cli.build_parser()
    args = parser.parse_args(["node", "--tls-cert", str(pki / "node.pem"), "--tls-key", str(pki / "node.key"),
                              "--tls-ca", str(pki / "ca.pem"), "--tls-require-client-cert",
                              "--tls-server-name", "localhost", "--auth-token", TOKEN])
    config = cli.config_from_args(args)
    sec = security_from_settings(config)
    assert (sec.tls_cert, sec.tls_ca, sec.token, sec.require_client_cert, sec.tls_server_name) == \
        (str(pki / "node.pem"), str(pki / "ca.pem"), TOKEN, True, "localhost")
    plain = NodeConfig.from_sources(env={})
    assert config.fingerprint() == plain.fingerprint()  # security settings are not shared state
    assert TOKEN not in repr(config) and TOKEN not in repr(sec) and TOKEN not in str(config.to_dict())
    assert config.to_dict()["auth_token"] == "<redacted>"

    toml = tmp_path / "node.toml"
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    toml.write_text("\n".join(f'{k} = "{v}"' for k, v in _files(pki).items())
                    + f'\nauth_token_file = "{token_file}"\ntls_require_client_cert = true\n')
    config = NodeConfig.from_sources(toml_path=toml, env={})
    assert security_from_settings(config).token == TOKEN and config.tls_require_client_cert is True
    config = NodeConfig.from_sources(env={"P2PTRAIN_AUTH_TOKEN": TOKEN, "P2PTRAIN_TLS_REQUIRE_CLIENT_CERT": "no",
                                          **{f"P2PTRAIN_{k.upper()}": v for k, v in _files(pki).items()}})
    assert security_from_settings(config).token == TOKEN and config.tls_require_client_cert is False
    assert security_from_settings(NodeConfig.from_sources(env={})) == Security()

    # launch re-emits the TLS flags (the switch alone) to its nodes, but the token only by environment
    launch = parser.parse_args(["launch", "--nodes", "2", "--tls-cert", str(pki / "node.pem"), "--tls-key",
                                str(pki / "node.key"), "--tls-ca", str(pki / "ca.pem"),
                                "--tls-require-client-cert", "--auth-token", TOKEN])
    argv = cli.node_flags_as_argv(launch)
    assert TOKEN not in argv and "--tls-require-client-cert" in argv and str(pki / "ca.pem") in argv
    again = parser.parse_args(["node", *argv])
    assert again.tls_require_client_cert is True and again.tls_cert == str(pki / "node.pem")


@pytest.mark.parametrize("settings, message", [
    ({"auth_token": ""}, "empty"),
    ({"auth_token": "   "}, "empty"),
    ({"auth_token": "two words"}, "visible ASCII"),
    ({"tls_cert": "CERT"}, "come together"),
    ({"tls_cert": "CERT", "tls_key": "/nonexistent/key.pem"}, "not a readable file"),
    ({"tls_ca": "CA"}, "needs --tls-cert"),
    ({"auth_token": "a", "auth_token_file": "TOKENFILE"}, "once"),
    ({"auth_token_file": "EMPTYFILE"}, "empty"),
    ({"tls_require_client_cert": True, "tls_cert": "CERT", "tls_key": "KEY"}, "needs --tls-ca"),
    ({"tls_server_name": "x"}, "only applies to TLS"),
    ({"tls_require_client_cert": "maybe"}, "not a valid bool"),
])
def test_security_settings_are_validated(pki, tmp_path, settings, message):
    (tmp_path / "empty").write_text("\n")
    (tmp_path / "token").write_text("x")
    names = {"CERT": str(pki / "node.pem"), "KEY": str(pki / "node.key"), "CA": str(pki / "ca.pem"),
             "TOKENFILE": str(tmp_path / "token"), "EMPTYFILE": str(tmp_path / "empty")}
    flags = {k: names.get(v, v) if isinstance(v, str) else v for k, v in settings.items()}
    with pytest.raises(ConfigError, match=message):
        NodeConfig.from_sources(env={}, flags=flags)


def test_security_object_checks():
    with pytest.raises(SecurityError, match="come together"):
        Security(tls_cert="a.pem")
    with pytest.raises(SecurityError, match="empty"):
        Security(token="")
    ((key, value),) = Security(token="t0ken").call_metadata(HELLO_METHOD, "1", "0")
    scheme, version, sender, receiver, window, nonce, mac = value.split(" ")
    assert (key, scheme, version, sender, receiver) == ("authorization", "P2P-HMAC", "1", "1", "0")
    assert "t0ken" not in value and len(nonce) == 32 and len(mac) == 64 and window.isdigit()
    assert Security(token="t0ken").call_metadata(HELLO_METHOD, "1", "0") != ((key, value),)  # a fresh nonce
    assert Security().call_metadata(HELLO_METHOD, "1", "0") is None and not Security().tls
    with pytest.raises(SecurityError, match="its own name"):
        Security(token="t").server_interceptors()
