"""In-process calls between nodes that share one event loop (`p2ptrain simulate`).

A Hello, Settle or DialBack to a node of the same process goes straight to its PeerService,
serialized both ways as gRPC would, but without a channel, HTTP/2 frames or grpc.aio's poller
thread: at 1,024 simulated nodes on 2 cores those never got through the start-up greetings. The
calls are counted (NodeMetrics.on_rpc) as gRPC ones are, fail as SendFailures of the same kinds,
and time out the same way; a node that stopped is no longer registered, so a call to it goes by
gRPC and finds nothing listening. Tensor pushes keep their paths (the lane, gRPC streams).
"""
from __future__ import annotations

import asyncio
from typing import Callable

import grpc

from p2ptrain.transport.errors import FailureKind, SendFailure
from p2ptrain.transport.paths.grpc_path import DIAL_BACK_METHOD, HELLO_METHOD, SETTLE_METHOD, PeerClient, kind_of


class CallAborted(Exception):
    """A handler ended the call with a status (what grpc.aio's context.abort does)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


class LocalContext:
    """What a PeerService handler asks of its call's context, for an in-process call from `peer`
    ("ipv4:HOST:0", as grpc.aio's context.peer() names a caller)."""

    def __init__(self, peer: str):
        self._peer = peer

    def peer(self) -> str:
        return self._peer

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise CallAborted(code, details)


class LocalServices:
    """The Peer services of the nodes that share one loop, by the address they listen on. Only
    services that check no token or node identity register: those checks need the real call."""

    def __init__(self) -> None:
        self._services: dict[str, object] = {}

    def register(self, address: str, service) -> None:
        self._services[address] = service

    def unregister(self, address: str, service) -> None:
        if self._services.get(address) is service:
            del self._services[address]

    def service(self, address: str):
        """The PeerService listening at `address` in this process (None: call it by gRPC)."""
        return self._services.get(address)


class LocalClient:
    """A PeerClient's calls made in-process on `service`, the callee's PeerService. Pushes (and
    forwarded streams) go through `direct()`, the real client to the same node."""

    def __init__(self, service, direct: Callable[[], PeerClient], caller_host: str, metrics=None):
        self.service = service
        self.direct = direct
        self.metrics = metrics
        self._context = LocalContext(f"ipv4:{caller_host}:0")

    async def hello(self, request, timeout: float | None, wait_for_ready: bool = True):
        return await self._call(HELLO_METHOD, self.service.hello, request, timeout)

    async def settle(self, request, timeout: float | None):
        return await self._call(SETTLE_METHOD, self.service.settle, request, timeout)

    async def dial_back(self, request, timeout: float):
        return await self._call(DIAL_BACK_METHOD, self.service.dial_back_call, request, timeout)

    async def push(self, header, payload, timeout: float | None, wait_for_ready: bool = True):
        return await self.direct().push(header, payload, timeout, wait_for_ready=wait_for_ready)

    def open_push(self, timeout: float | None, wait_for_ready: bool = True):
        return self.direct().open_push(timeout, wait_for_ready)

    async def _call(self, method: str, handler, request, timeout: float | None):
        data = request.SerializeToString()
        if self.metrics is not None:
            self.metrics.on_rpc(method.rsplit("/", 1)[1], len(data))
        try:
            reply = await asyncio.wait_for(handler(type(request).FromString(data), self._context), timeout)
        except CallAborted as exc:
            raise SendFailure(kind_of(exc.code), f"{exc.code.name}: {' '.join(exc.details.split())}") from None
        except asyncio.TimeoutError:
            raise SendFailure(FailureKind.TIMEOUT, f"DEADLINE_EXCEEDED: no answer within {timeout:.3g} s "
                                                   "(in-process call)") from None
        except Exception as exc:  # noqa: BLE001 - what a gRPC server answers a handler's bug with
            raise SendFailure(FailureKind.BROKEN, f"UNKNOWN: {type(exc).__name__}: {exc}") from None
        return type(reply).FromString(reply.SerializeToString())


__all__ = ["CallAborted", "LocalClient", "LocalContext", "LocalServices"]
