"""The standard gRPC health service (grpc.health.v1.Health) of nodes and the parameter server, and
the client behind `p2ptrain health`.

Orchestrators ask it whether a process is worth sending work to (docker-compose healthchecks,
Kubernetes `grpc:` probes, grpc_health_probe). The answer is SERVING or NOT_SERVING, for the whole
server ("") and for its own service (p2ptrain.v1.Peer / p2ptrain.v1.ParameterServer):
- a node is NOT_SERVING until its algorithm is set up (Transport.mark_ready), SERVING afterwards,
  and NOT_SERVING for good once it starts draining (the start of Transport.stop);
- the parameter server is SERVING once started and NOT_SERVING once it stops.
Health calls need no token (security.py says why, at TOKEN_EXEMPT_PREFIX); TLS still applies. The
servicer is the official grpcio-health-checking one, never imported at module level, so
`import p2ptrain` and `p2ptrain --help` stay light.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
from typing import TYPE_CHECKING

import grpc

if TYPE_CHECKING:
    from p2ptrain.transport.security import Security

# == grpc_health.v1.health.SERVICE_NAME, spelled out so that the token interceptor can exempt it
# without importing grpc_health (tests/test_health.py checks that the two agree).
HEALTH_SERVICE_NAME = "grpc.health.v1.Health"
OVERALL = ""  # the service name that stands for the whole server
SERVING = "SERVING"
NOT_SERVING = "NOT_SERVING"
SERVICE_UNKNOWN = "SERVICE_UNKNOWN"
LOOP_CHECK_SECONDS = 1.0  # while waiting for the loop to apply a status: how often to check it still runs


class ServingStatus:
    """What the Health service of one grpc.aio server answers, for "" and its own service name.

    `set_serving` may be called from any thread (a node's training thread marks it ready); `drain`
    runs on the server's loop at the start of a graceful stop and cannot be undone, so a node that
    is shutting down never reads as SERVING again."""

    def __init__(self, servicer, service_name: str, loop: asyncio.AbstractEventLoop):
        self._servicer = servicer
        self.service_name = service_name
        self._loop = loop

    async def _apply(self, serving: bool) -> None:
        from grpc_health.v1 import health_pb2

        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in (OVERALL, self.service_name):
            await self._servicer.set(service, status)

    def set_serving(self, serving: bool) -> None:
        """SERVING or NOT_SERVING from now on (ignored once draining, or when the loop is gone).
        From another thread it waits until the loop has applied it, however busy the loop is
        (hundreds of simulated nodes share one), unless the loop stops meanwhile."""
        if self._loop.is_closed() or not self._loop.is_running():
            return
        try:
            on_loop = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            self._loop.create_task(self._apply(serving))
        else:
            applied = asyncio.run_coroutine_threadsafe(self._apply(serving), self._loop)
            while self._loop.is_running():
                try:
                    return applied.result(LOOP_CHECK_SECONDS)
                except concurrent.futures.TimeoutError:
                    continue
            applied.cancel()

    async def drain(self) -> None:
        """NOT_SERVING for good; open Watch streams hear it before the server stops."""
        await self._servicer.enter_graceful_shutdown()


async def add_standard_services(server: grpc.aio.Server, service_name: str, *, serving: bool) -> ServingStatus:
    """Add grpc.health.v1.Health (answering SERVING or NOT_SERVING per `serving`) and server
    reflection listing `service_name`, Health and reflection itself, to a grpc.aio server that is
    not started yet; call on its event loop. Returns the status to flip later."""
    from grpc_health.v1 import health_pb2_grpc
    from grpc_health.v1.health import aio
    from grpc_reflection.v1alpha import reflection

    servicer = aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    reflection.enable_server_reflection((service_name, HEALTH_SERVICE_NAME, reflection.SERVICE_NAME), server)
    status = ServingStatus(servicer, service_name, asyncio.get_running_loop())
    await status._apply(serving)
    return status


# Client ------------------------------------------------------------------------------------------
def check(address: str, service: str = OVERALL, *, timeout: float = 5.0, security: "Security | None" = None) -> str:
    """Ask the server at `address` once: "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN" (it does not
    know `service`) or "UNKNOWN". Raises SendFailure when there is no answer (nothing listens,
    TLS handshake failed, timeout, no Health service)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from p2ptrain.transport.paths.grpc_path import failure_from
    from p2ptrain.transport.security import PLAINTEXT

    channel = (security or PLAINTEXT).channel(address, [])
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:  # the servicer's answer for a service it does not know
                return SERVICE_UNKNOWN
            raise failure_from(exc) from None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    finally:
        channel.close()


__all__ = ["ServingStatus", "add_standard_services", "check", "HEALTH_SERVICE_NAME", "OVERALL", "SERVING",
           "NOT_SERVING", "SERVICE_UNKNOWN"]
