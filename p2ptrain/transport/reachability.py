"""Reachability: can the other nodes dial this one at the address they hold for it?

A node behind NAT or a firewall dials out but cannot be dialled: it is *private*. At start it asks
one or two peers it reached to dial it back (DialBack): a fresh gRPC connection to the address
they hold for it, answered by its own incarnation, and a connect to its lane, which must open with
a LaneChallenge. Public only if every helper that answered got through; private if one failed (a
helper on its own LAN gets through where the world does not); unknown if none answered.

A helper dials only what it holds for the asker, never an address from the request (DialBack
cannot aim a node at a third party), one dial at a time and one per asker a second at most.
"""
from __future__ import annotations

import asyncio
import ipaddress
import time

from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.addresses import split_address
from p2ptrain.transport.errors import SendFailure
from p2ptrain.transport.laneframes import LANE_PROTOCOL, LaneFrameError, decode
from p2ptrain.transport.paths.grpc_path import GrpcPath
from p2ptrain.transport.paths.lane_path import LaneConnection, LanePorts
from p2ptrain.transport.security import Security

NAMES = {"auto": pb.REACHABILITY_UNKNOWN, "public": pb.REACHABILITY_PUBLIC, "private": pb.REACHABILITY_PRIVATE}
SHOWN = {pb.REACHABILITY_UNKNOWN: "unknown", pb.REACHABILITY_PUBLIC: "public", pb.REACHABILITY_PRIVATE: "private"}
HELPERS = 2  # peers asked to dial back (one may be unable to answer)
MIN_INTERVAL = 1.0  # seconds between two dial-backs of one node: a flood of DialBacks costs one dial a second
DIAL_SECONDS = 5.0  # at least this long for each dial back: a busy machine must not make a node private


class DialBack:
    """The helper's side: dial node `request.node_id` back at what this node holds for it."""

    def __init__(self, rank: int, grpc: GrpcPath, lane_ports: LanePorts | None, security: Security, *,
                 hello, timeout: float):
        self.rank = rank
        self.grpc = grpc
        self.lane_ports = lane_ports
        self.security = security
        self.hello = hello  # () -> pb.HelloRequest: this node's own Hello
        self.timeout = max(timeout, DIAL_SECONDS)
        self._one_at_a_time = asyncio.Lock()
        self._last: dict[int, tuple[float, int, pb.DialBackReply]] = {}  # asker -> (when, incarnation, reply)

    async def answer(self, request: pb.DialBackRequest, observed: str = "") -> pb.DialBackReply | None:
        """The outcome of dialling the asker back; None (the caller says RESOURCE_EXHAUSTED) when
        it was dialled less than MIN_INTERVAL ago as another incarnation (the same one gets that
        outcome again)."""
        asker = request.node_id
        if not 0 <= asker < len(self.grpc.addresses) or asker == self.rank or not self.grpc.addresses[asker]:
            return pb.DialBackReply(detail=f"node {self.rank} holds no address for node {asker}")
        async with self._one_at_a_time:
            last = self._last.get(asker)
            if last is not None and time.monotonic() - last[0] < MIN_INTERVAL:
                return last[2] if last[1] == request.incarnation else None
            grpc_ok, problems = await self._dial_grpc(asker, request.incarnation), []
            if grpc_ok is not True:
                problems.append(grpc_ok)
            port = self.lane_ports.advertised(asker) if self.lane_ports is not None else 0
            lane_ok = await self._dial_lane(asker, port) if port else True
            if lane_ok is not True:
                problems.append(lane_ok)
            reply = pb.DialBackReply(grpc_ok=grpc_ok is True, lane_checked=bool(port),
                                     lane_ok=bool(port) and lane_ok is True, detail="; ".join(problems),
                                     observed=observed)
            self._last[asker] = (time.monotonic(), request.incarnation, reply)
        return reply

    async def _dial_grpc(self, asker: int, incarnation: int) -> bool | str:
        """True, or what went wrong dialling the asker's gRPC address afresh."""
        address = self.grpc.addresses[asker]
        client = self.grpc.fresh_client(asker)
        try:
            reply = await client.hello(self.hello(), self.timeout, wait_for_ready=False)
        except SendFailure as exc:
            return f"node {self.rank} could not dial {address}: {exc}"
        finally:
            await client.close()
        if reply.node_id != asker or reply.incarnation != incarnation:
            return f"node {self.rank} reached another process at {address} (node {reply.node_id})"
        return True

    async def _dial_lane(self, asker: int, port: int) -> bool | str:
        """True, or what went wrong connecting to the asker's lane (its challenge read, then closed)."""
        host = (split_address(self.grpc.addresses[asker]) or ("", 0))[0]
        where = f"node {self.rank} could not open the lane at {host}:{port}"
        ssl = self.security.lane_client_context()
        connection = None
        try:
            _, connection = await asyncio.wait_for(asyncio.get_running_loop().create_connection(
                LaneConnection, host, port, ssl=ssl,
                server_hostname=self.security.lane_server_name(host) if ssl else None), self.timeout)
            challenge = decode(pb.LaneChallenge, await asyncio.wait_for(connection.frame(), self.timeout))
        except (OSError, asyncio.TimeoutError, LaneFrameError) as exc:
            return f"{where}: {type(exc).__name__}: {exc}"
        finally:
            if connection is not None and connection.transport is not None:
                connection.transport.close()
        if challenge.protocol_version != LANE_PROTOCOL:
            return f"{where}: it speaks {challenge.protocol_version[:40]!r}"
        return True


def verdict(replies: list[pb.DialBackReply], own_host: str = "") -> int:
    """The asker's reachability from its helpers' replies (those that answered): public only if
    every one got through and none saw its calls come from another host than `own_host` (a NAT
    rewrote them). A helper on the asker's own LAN gets through where the rest of the world does
    not; a node judged private when it is not still works (it reaches out, and its peers call it
    down its streams), the other way round it would be cut off."""
    if not replies:
        return pb.REACHABILITY_UNKNOWN
    if all(r.grpc_ok and (r.lane_ok or not r.lane_checked) and not rewritten(r.observed, own_host) for r in replies):
        return pb.REACHABILITY_PUBLIC
    return pb.REACHABILITY_PRIVATE


def rewritten(observed: str, own_host: str) -> bool:
    """`observed` (where a helper saw our call come from) and `own_host` (the host we advertise)
    are both IP addresses and differ: our connections leave through a NAT. (A host name, or
    nothing observed, says nothing.)"""
    try:
        return ipaddress.ip_address(observed) != ipaddress.ip_address(own_host)
    except ValueError:
        return False


def observed_host(peer: str | None) -> str:
    """The host of a grpc.aio context's peer() ("ipv4:10.0.0.3:51234", "ipv6:[::1]:51234"); "" for
    anything else (a Unix socket)."""
    if not peer or not peer.startswith(("ipv4:", "ipv6:")):
        return ""
    host = peer.split(":", 1)[1].rsplit(":", 1)[0]
    return host.strip("[]")


def far_first(helpers: list[int], addresses: list[str], rank: int, world_size: int) -> list[int]:
    """`helpers` ordered for asking: those outside this node's own /24 (IPv4) or /64 (IPv6) first,
    which a NAT's LAN neighbours are not, then spread by rank."""
    def network(address: str):
        host = (split_address(address) or ("", 0))[0]
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return None
        return ipaddress.ip_network(f"{ip}/{24 if ip.version == 4 else 64}", strict=False)

    own = network(addresses[rank])
    return sorted(helpers, key=lambda peer: (own is not None and network(addresses[peer]) == own,
                                             (peer - rank) % world_size))


async def ask(grpc: GrpcPath, helpers: list[int], rank: int, incarnation: int, timeout: float,
              ) -> tuple[int, list[str]]:
    """Ask `helpers` (at most HELPERS of them, together) to dial node `rank` (of `incarnation`)
    back; the verdict and what each said."""
    request = pb.DialBackRequest(node_id=rank, incarnation=incarnation)
    own_host = (split_address(grpc.addresses[rank]) or ("", 0))[0]

    async def one(peer: int):
        client = grpc.client(peer)
        return peer, await client.dial_back(request, timeout)

    outcomes = await asyncio.gather(*(one(p) for p in helpers[:HELPERS]), return_exceptions=True)
    replies, notes = [], []
    for peer, outcome in zip(helpers, outcomes):
        if isinstance(outcome, BaseException):
            # (a call cancelled under us: its channel was reset, e.g. the helper came back from the
            # dead meanwhile. A chaos run's joiner crashed on that at start-up; it is no answer)
            if not isinstance(outcome, (SendFailure, OSError, asyncio.CancelledError)):
                raise outcome
            notes.append(f"node {peer} did not answer: {outcome}")
            continue
        reply = outcome[1]
        replies.append(reply)
        if reply.detail:
            notes.append(reply.detail)
        if rewritten(reply.observed, own_host):
            notes.append(f"node {peer} sees this node's calls come from {reply.observed[:60]}, not {own_host} (NAT)")
    return verdict(replies, own_host), notes


__all__ = ["DialBack", "HELPERS", "NAMES", "SHOWN", "ask", "far_first", "observed_host", "rewritten", "verdict"]
