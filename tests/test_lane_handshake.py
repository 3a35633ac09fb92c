"""The lane's handshake is bounded (issue 23): an absolute deadline from accept to an accepted proof
(TLS included) however the bytes trickle; TLS handshakes count among the handshakes from accept; one
source address holds at most MAX_HANDSHAKES_PER_SOURCE of them. Raw sockets against a real node on
loopback; bounds are generous (the suite passes beside a CPU hog), never exact timings."""
from __future__ import annotations

import os
import select
import socket
import time

import pytest
import torch

from launcher.ports import free_ports
from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.transport import Transport, TransportOptions
from p2ptrain.transport.lane_server import MAX_HANDSHAKES_PER_SOURCE
from p2ptrain.transport.laneframes import PREFIX
from p2ptrain.transport.security import Security
from tests.rawlane import RawLane
from tests.test_security import _client_tls, pki  # noqa: F401 - pki is a fixture
from tests.test_transport import on_loop, wait_until

TOKEN = "handshake-test-token"
DEADLINE = 1.0  # the node's handshake deadline in these tests (HANDSHAKE_SECONDS is 5)
N = 16


def node(security: Security) -> Transport:
    peers = [f"127.0.0.1:{p}" for p in free_ports(2)]
    options = TransportOptions(send_timeout=5.0, shutdown_grace=0.2, security=security, data_plane="tcp")
    t = Transport(0, 2, peers, listen=peers[0], options=options).start()
    t.expect(pb.MESSAGE_KIND_GOSSIP, torch.float32, N)

    def shorten() -> None:
        t.lane_server.handshake_seconds = DEADLINE

    on_loop(t, shorten)
    return t


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.socket()
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    return sock


def closed(sock: socket.socket) -> bool:
    """The node closed it (EOF or reset); reads and drops whatever came before."""
    while select.select([sock], [], [], 0)[0]:
        try:
            if not sock.recv(4096):
                return True
        except OSError:
            return True
    return False


def handshaking(t: Transport) -> tuple[int, dict[str, int]]:
    return on_loop(t, lambda: (t.lane_server.handshaking, dict(t.lane_server.handshaking_from)))


def _message() -> tuple[pb.TensorHeader, bytes]:
    x = torch.arange(N, dtype=torch.float32)
    h = pb.TensorHeader(sender=1, receiver=0, step=0, kind=pb.MESSAGE_KIND_GOSSIP, dtype=pb.DTYPE_FLOAT32, numel=N,
                        shape=[N], payload_bytes=4 * N, message_id=4242)
    return h, x.numpy().tobytes()


def test_trickling_handshakes_are_cut_at_the_deadline():
    """Before: each byte re-armed an idle timer, so 8 sockets sending a byte every 10 s stayed open
    for ever (and 64 took every handshake slot). Now the handshake has an absolute deadline."""
    t = node(Security(token=TOKEN))
    socks = []
    try:
        socks = [connect(t.lane_port) for _ in range(8)]
        trickle = PREFIX.pack(1000) + bytes(1000)  # an auth frame that would take minutes at this pace
        wait_until(lambda: handshaking(t)[0] == 8, 10, "8 handshakes")
        started, sent = time.monotonic(), 0
        open_ = set(range(8))
        while open_ and time.monotonic() - started < 30:  # generous: the deadline is 1 s
            for i in list(open_):
                try:
                    socks[i].send(trickle[sent:sent + 1])
                except OSError:
                    open_.discard(i)
                    continue
                if closed(socks[i]):
                    open_.discard(i)
            sent += 1
            time.sleep(0.1)  # far below stream_idle_timeout: an idle timer would never fire
        assert not open_, f"{len(open_)} trickling connections outlived the handshake deadline"
        wait_until(lambda: handshaking(t) == (0, {}), 10, "every handshake slot freed")
        h, payload = _message()
        with RawLane(t.lane_port, sender=1, receiver=0, token=TOKEN) as friend:  # the node still serves
            assert friend.verdict.accepted and friend.push(h, payload).status == pb.Ack.STATUS_ACCEPTED
    finally:
        for sock in socks:
            sock.close()
        t.stop()


def test_silent_tls_handshakes_from_one_source_are_capped_and_cost_nothing_after(pki):  # noqa: F811
    """Before: TLS handshakes in progress were not counted: 300 silent sockets held +299 fds and
    +22 MB until reaped at ~30 s. Now they count from accept, one source holds at most
    MAX_HANDSHAKES_PER_SOURCE of them, a real peer still gets in, and the deadline frees the rest."""
    security = Security(tls_cert=str(pki / "node.pem"), tls_key=str(pki / "node.key"), tls_ca=str(pki / "ca.pem"),
                        token=TOKEN)
    t = node(security)
    flood: list[socket.socket] = []
    try:
        baseline = open_fds()
        flood = [connect(t.lane_port, source="127.0.0.2") for _ in range(60)]  # connect, never say a word
        wait_until(lambda: on_loop(t, lambda: t.lane_server.turned_away) >= 60 - MAX_HANDSHAKES_PER_SOURCE, 10,
                   "the flood beyond the per-source cap turned away")
        count, per_source = handshaking(t)
        assert count <= MAX_HANDSHAKES_PER_SOURCE and per_source.get("127.0.0.2", 0) <= MAX_HANDSHAKES_PER_SOURCE
        h, payload = _message()
        with RawLane(t.lane_port, sender=1, receiver=0, token=TOKEN, tls=_client_tls(pki)) as friend:
            assert friend.verdict.accepted and friend.push(h, payload).status == pb.Ack.STATUS_ACCEPTED
        wait_until(lambda: all(closed(sock) for sock in flood), 30, "the silent handshakes cut at the deadline")
        wait_until(lambda: handshaking(t) == (0, {}), 10, "every handshake slot freed")
        for sock in flood:
            sock.close()
        flood = []
        # (slack of 2: a descriptor or two the loop or grpc may open meanwhile; before, +1 per silent socket)
        wait_until(lambda: open_fds() <= baseline + 2, 10, f"descriptors back to {baseline} (now {open_fds()})")
    finally:
        for sock in flood:
            sock.close()
        t.stop()


@pytest.mark.parametrize("tls", [False, True])
def test_an_honest_node_pair_still_uses_the_lane(pki, tls):  # noqa: F811
    security = Security(tls_cert=str(pki / "node.pem"), tls_key=str(pki / "node.key"), tls_ca=str(pki / "ca.pem"),
                        token=TOKEN) if tls else Security(token=TOKEN)
    peers = [f"127.0.0.1:{p}" for p in free_ports(2)]
    options = TransportOptions(send_timeout=10.0, shutdown_grace=0.2, security=security, data_plane="tcp")
    pair = [Transport(r, 2, peers, listen=peers[r], options=options).start() for r in range(2)]
    try:
        pair[0].expect(pb.MESSAGE_KIND_GOSSIP, torch.float32, N)
        pair[1].membership.wait_for_peers(10)
        x = torch.linspace(0, 1, N)
        assert pair[1].sender.send(0, x, kind=pb.MESSAGE_KIND_GOSSIP, step=0).result(10).status == \
            pb.Ack.STATUS_ACCEPTED
        assert torch.equal(pair[0].recv(pb.MESSAGE_KIND_GOSSIP, 0, [1], timeout=10)[1].tensor, x)
    finally:
        for t in pair:
            t.stop()


def test_silent_plain_sockets_from_one_source_leave_room_for_others():
    """The per-source cap without TLS: silent sockets from 127.0.0.2 hold at most their share, and a
    node connecting from 127.0.0.1 meanwhile is authenticated at once."""
    t = node(Security(token=TOKEN))
    flood: list[socket.socket] = []
    try:
        flood = [connect(t.lane_port, source="127.0.0.2") for _ in range(MAX_HANDSHAKES_PER_SOURCE + 12)]
        wait_until(lambda: on_loop(t, lambda: t.lane_server.turned_away) >= 12, 10, "the surplus turned away")
        assert handshaking(t)[1] == {"127.0.0.2": MAX_HANDSHAKES_PER_SOURCE}
        with RawLane(t.lane_port, sender=1, receiver=0, token=TOKEN) as friend:
            assert friend.verdict.accepted
        wait_until(lambda: handshaking(t) == (0, {}), 30, "the deadline freed every slot")
    finally:
        for sock in flood:
            sock.close()
        t.stop()
