"""The standard gRPC health service on real servers on loopback: a node is NOT_SERVING until it is
ready, SERVING afterwards and NOT_SERVING while it drains; the parameter server is SERVING; Health
needs no token while every other call still does; TLS applies to it; `p2ptrain health` exits 0 / 1 /
2 for SERVING / anything else / no answer."""
from __future__ import annotations

import subprocess
import sys
import threading
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health as grpc_health
from grpc_health.v1 import health_pb2, health_pb2_grpc

from launcher.ports import free_ports
from p2ptrain import cli
from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.ps.client import PsClient, PsError
from p2ptrain.ps.server import PS_SERVICE_NAME, ParameterServer
from p2ptrain.transport import FailureKind, SendFailure, Transport, TransportOptions
from p2ptrain.transport.health import HEALTH_SERVICE_NAME, check
from p2ptrain.transport.security import Security
from p2ptrain.transport.server import HELLO_METHOD, PROTOCOL_VERSION, PUSH_METHOD, SERVICE_NAME
from tests.conftest import ROOT, node_env
from tests.test_security import pki  # noqa: F401 - the module-scoped test PKI fixture

torch.set_num_threads(1)
pytestmark = pytest.mark.timeout(60)

TOKEN = "health-test-token"
GRACE = 1.0  # long enough to look at the server while its stop() waits


def _transport(*, security: Security = Security(), ready: bool = False) -> Transport:
    address = f"127.0.0.1:{free_ports(1)[0]}"
    options = TransportOptions(send_timeout=5.0, shutdown_grace=GRACE, security=security)
    transport = Transport(0, 1, [address], listen=address, options=options).start()
    if ready:
        transport.mark_ready()
    return transport


def _address(server) -> str:
    return f"127.0.0.1:{server.port}"


def _status_while_stopping(address: str, service: str, stop) -> tuple[str, str, float]:
    """Watch `service`, call stop() on another thread, and return (status before, status heard
    while stop() was still running, stop's duration)."""
    channel = grpc.insecure_channel(address)
    stream = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=service), timeout=20)
    name = health_pb2.HealthCheckResponse.ServingStatus.Name
    stopped: list[float] = []
    stopper = threading.Thread(target=lambda: stopped.append(_timed(stop)))
    try:
        before = name(next(stream).status)
        stopper.start()
        during = name(next(stream).status)
        assert not stopped, "stop() returned before the drain was observable"
    finally:
        stream.cancel()  # ends the last open RPC: the server may finish stopping now
        stopper.join(GRACE + 15)
        channel.close()
    return before, during, stopped[0]


def _timed(fn) -> float:
    start = time.monotonic()
    fn()
    return time.monotonic() - start


def test_service_name_is_the_standard_one():
    assert HEALTH_SERVICE_NAME == grpc_health.SERVICE_NAME == "grpc.health.v1.Health"


def test_node_is_serving_only_between_ready_and_stop():
    node = _transport()
    address = _address(node)
    try:
        assert (check(address), check(address, SERVICE_NAME)) == ("NOT_SERVING", "NOT_SERVING")
        assert check(address, PS_SERVICE_NAME) == "SERVICE_UNKNOWN"  # not a service of a node
        node.mark_ready()
        assert (check(address), check(address, SERVICE_NAME)) == ("SERVING", "SERVING")
        # Health sits in reflection, beside the Peer service (no token configured here)
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

        with grpc.insecure_channel(address) as channel:
            request = reflection_pb2.ServerReflectionRequest(list_services="")
            reply = next(reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(iter([request]),
                                                                                                timeout=5))
        assert {HEALTH_SERVICE_NAME, SERVICE_NAME} <= {s.name for s in reply.list_services_response.service}
    except BaseException:
        node.stop()
        raise
    before, during, seconds = _status_while_stopping(address, SERVICE_NAME, node.stop)
    assert (before, during) == ("SERVING", "NOT_SERVING")
    assert seconds < GRACE + 5
    node.mark_ready()  # after stop: no loop to flip anything on, and no error
    with pytest.raises(SendFailure) as gone:
        check(address, timeout=2)
    assert gone.value.kind is FailureKind.UNREACHABLE and gone.value.detail.startswith("UNAVAILABLE: ")


def test_parameter_server_is_serving_and_drains_on_stop():
    server = ParameterServer(torch.zeros(4), 1, listen="127.0.0.1:0", shutdown_grace=GRACE).start()
    address = _address(server)
    try:
        assert (check(address), check(address, PS_SERVICE_NAME)) == ("SERVING", "SERVING")
        assert check(address, SERVICE_NAME) == "SERVICE_UNKNOWN"
    except BaseException:
        server.stop()
        raise
    assert _status_while_stopping(address, "", server.stop)[:2] == ("SERVING", "NOT_SERVING")


def _unauthenticated_push(address: str) -> grpc.StatusCode:
    with grpc.insecure_channel(address) as channel:
        push = channel.stream_unary(PUSH_METHOD, request_serializer=lambda b: b,
                                    response_deserializer=pb.Ack.FromString)
        try:
            push(iter([b"\x00"]), timeout=5)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def _unauthenticated_hello(address: str) -> grpc.StatusCode:
    with grpc.insecure_channel(address) as channel:
        hello = channel.unary_unary(HELLO_METHOD, request_serializer=pb.HelloRequest.SerializeToString,
                                    response_deserializer=pb.HelloReply.FromString)
        try:
            hello(pb.HelloRequest(node_id=0, world_size=1, protocol_version=PROTOCOL_VERSION), timeout=5)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def test_health_needs_no_token_everything_else_does():
    node = _transport(security=Security(token=TOKEN), ready=True)
    try:
        address = _address(node)
        assert check(address) == "SERVING" and check(address, SERVICE_NAME) == "SERVING"
        assert _unauthenticated_hello(address) == grpc.StatusCode.UNAUTHENTICATED
        assert _unauthenticated_push(address) == grpc.StatusCode.UNAUTHENTICATED
        assert node.options.security.server_interceptors(name="0")  # (the token is really on)
    finally:
        node.stop()
    with ParameterServer(torch.zeros(4), 1, listen="127.0.0.1:0", shutdown_grace=0.2,
                         security=Security(token=TOKEN)) as server:
        assert check(_address(server), PS_SERVICE_NAME) == "SERVING"
        with PsClient(_address(server), 0, timeout=5, retries=0) as stranger:
            with pytest.raises(PsError) as refused:
                stranger.pull()
        assert refused.value.reason == "UNAUTHENTICATED"


def test_cli_exit_codes(capsys):
    node = _transport()
    address = _address(node)
    try:
        assert cli.main(["health", address]) == 1
        assert capsys.readouterr().out == "NOT_SERVING\n"
        node.mark_ready()
        assert cli.main(["health", address, "--service", SERVICE_NAME, "--timeout", "3"]) == 0
        assert capsys.readouterr().out == "SERVING\n"
        assert cli.main(["health", address, "--service", "no.such.Service"]) == 1
        assert capsys.readouterr().out == "SERVICE_UNKNOWN\n"
        # the installed command, as a compose healthcheck runs it
        proc = subprocess.run([sys.executable, "-m", "p2ptrain", "health", address], cwd=ROOT, env=node_env(),
                              capture_output=True, text=True, timeout=60)
        assert (proc.returncode, proc.stdout) == (0, "SERVING\n"), proc.stderr
    finally:
        node.stop()
    assert cli.main(["health", address, "--timeout", "2"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith(f"p2ptrain health: {address}: UNAVAILABLE: ")
    assert out.err.count("\n") == 1


def test_cli_over_tls_and_mutual_tls(pki):  # noqa: F811 - the fixture
    files = {"tls_cert": str(pki / "node.pem"), "tls_key": str(pki / "node.key"), "tls_ca": str(pki / "ca.pem")}
    node = _transport(security=Security(**files, token=TOKEN, require_client_cert=True), ready=True)
    address = _address(node).replace("127.0.0.1", "localhost")  # the name in the certificate
    ca = ["--tls-ca", files["tls_ca"]]
    client_cert = ["--tls-cert", files["tls_cert"], "--tls-key", files["tls_key"]]
    try:
        assert cli.main(["health", address, *ca, *client_cert]) == 0  # TLS, client cert, no token
        assert cli.main(["health", _address(node), *ca, *client_cert, "--tls-server-name", "localhost"]) == 0
        assert cli.main(["health", address, *ca, "--timeout", "2"]) == 2  # no client certificate
        assert cli.main(["health", address, "--timeout", "2"]) == 2  # plaintext against TLS
        assert cli.main(["health", address, "--tls-ca", str(pki / "rogue-ca.pem"), *client_cert,
                         "--timeout", "2"]) == 2  # does not trust the server
    finally:
        node.stop()
    with pytest.raises(SystemExit) as bad:
        cli.main(["health", address, "--tls-server-name", "localhost"])
    assert bad.value.code == 2
