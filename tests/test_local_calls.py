"""In-process calls between the nodes of one loop (paths/local_calls.py): what `p2ptrain simulate`
uses so that 1,024 nodes on 2 cores are not held up by gRPC's own cost. Real Transports on one
shared LoopThread: a Hello goes straight to the callee's service (no channel is opened), is
counted as a call, and a stopped callee is called by gRPC again and found gone."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from launcher.ports import free_ports
from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.metrics import NodeMetrics
from p2ptrain.transport import Transport, TransportOptions
from p2ptrain.transport.errors import FailureKind, SendFailure
from p2ptrain.transport.loop_thread import LoopThread
from p2ptrain.transport.paths.local_calls import LocalClient, LocalServices
from p2ptrain.transport.security import Security


async def _nothing() -> None:
    return None


@pytest.fixture
def host():
    loop = LoopThread("test-host", "shared loop")
    yield loop
    loop.stop(_nothing, grace=1)


def _start(host: LoopThread, local: LocalServices, ranks, *, options: TransportOptions | None = None):
    peers = [f"127.0.0.1:{port}" for port in free_ports(3)]
    options = options or TransportOptions(probe_timeout=2.0)
    return [Transport(rank, 3, peers, listen=peers[rank], options=options, metrics=NodeMetrics(rank), loop=host,
                      local=local).start() for rank in ranks]


def test_a_hello_between_nodes_of_one_loop_goes_in_process_and_is_counted_as_a_call(host):
    local = LocalServices()
    first, second = _start(host, local, (0, 1))
    try:
        reply = first.loop.submit(first.membership.greetings.hello(1, 5.0)).result(10)
        assert reply.compatible and reply.node_id == 1
        assert first.grpc.channels == 1 and first.grpc.grpc_channels == 0  # an in-process link, no gRPC channel
        assert first.metrics.rpc_totals["Hello"][0] >= 1  # counted as gRPC calls are
        assert 0 in second.membership.greetings.announced  # the callee heard of the caller
    finally:
        first.stop()
        second.stop()


def test_a_stopped_node_is_called_by_grpc_again_and_found_gone(host):
    local = LocalServices()
    first, second = _start(host, local, (0, 1))
    try:
        first.loop.submit(first.membership.greetings.hello(1, 5.0)).result(10)
        second.stop()
        assert local.service(first.peers[1]) is None
        with pytest.raises(SendFailure) as failure:
            first.loop.submit(first.membership.greetings.hello(1, 2.0, wait_for_ready=False)).result(10)
        assert failure.value.kind is FailureKind.GONE
    finally:
        first.stop()


def test_nodes_that_check_a_token_make_real_calls(host):
    local = LocalServices()
    options = TransportOptions(probe_timeout=2.0, security=Security(token="s3cret"))
    first, second = _start(host, local, (0, 1), options=options)
    try:
        assert first.local is None and local.service(first.peers[1]) is None
        reply = first.loop.submit(first.membership.greetings.hello(1, 5.0)).result(10)
        assert reply.compatible and first.grpc.grpc_channels == 1  # by gRPC, through the token check
    finally:
        first.stop()
        second.stop()


class _Callee:
    """A Peer service that answers a Hello as told: late, with a status, or with a bug."""

    def __init__(self, how: str):
        self.how = how

    async def hello(self, request, context):
        if self.how == "late":
            await asyncio.sleep(5)
        if self.how == "abort":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad\nrequest")
        if self.how == "bug":
            raise ValueError("a handler's bug")
        return pb.HelloReply(node_id=request.node_id + 1, compatible=True, step=7)


@pytest.mark.parametrize("how, kind", [("late", FailureKind.TIMEOUT), ("abort", FailureKind.PROTOCOL),
                                       ("bug", FailureKind.BROKEN), ("ok", None)])
def test_an_in_process_call_fails_as_a_grpc_call_would(how, kind):
    client = LocalClient(_Callee(how), direct=lambda: None, caller_host="127.0.0.1")
    call = client.hello(pb.HelloRequest(node_id=3), timeout=0.2)
    if kind is None:
        reply = asyncio.run(call)
        assert (reply.node_id, reply.compatible, reply.step) == (4, True, 7)
        return
    with pytest.raises(SendFailure) as failure:
        asyncio.run(call)
    assert failure.value.kind is kind and "\n" not in failure.value.detail
