"""Linux network-namespace cluster: every node its own namespace, address and tbf-shaped link.

Loopback has neither distinct hosts nor a bandwidth limit. Here each rank gets a namespace joined to
a per-run bridge by a veth pair, an address of a private /24 that clashes with no route of this
machine, and optionally a real kernel bandwidth cap (``tc qdisc ... tbf`` on both ends of its link,
like an access link); delay and loss stay with the in-process link emulation (``--link``).
Everything a run creates is removed when the `NetnsCluster` context exits, on success, error, Ctrl-C
or SIGTERM; what a SIGKILLed launcher leaves behind is removed by `sweep_stale()` at the next start.
Needs root (CAP_NET_ADMIN for links and qdiscs, CAP_SYS_ADMIN for ``ip netns``). Names, addresses
and tbf settings: docs/faults.md, "How it is built".
"""
from __future__ import annotations

import argparse
import ipaddress
import json
import math
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

PREFIX = "p2p"
STATE_DIR = Path("/run/p2ptrain-netns")   # one file per live run: owner pid + its start time
NS_IFNAME = "eth0"                        # the veth end inside every namespace
# Candidate subnets 10.<a>.<b>.0/24 for a run; the first free one after a run-dependent offset.
SUBNET_FIRST_A, SUBNET_LAST_A = 200, 254
# tbf: the bucket must hold at least one timer tick of traffic (rate / HZ, HZ <= 250 assumed) and
# a few MTU-sized frames (GSO super-packets are segmented by tbf); larger buckets only let short
# bursts exceed the rate. Packets may queue for TBF_LATENCY before being dropped: long enough that
# TCP is not forced into loss recovery at every burst, short enough not to bloat round trips.
TBF_MIN_BURST_BYTES = 16 * 1024
TBF_HZ = 250
TBF_LATENCY = "100ms"
_CAP_NET_ADMIN, _CAP_SYS_ADMIN = 12, 21
_RUN_ID = re.compile(r"^[0-9a-f]{4}$")
_OWNED = re.compile(rf"^{PREFIX}(?:br([0-9a-f]{{4}})|([0-9a-f]{{4}})[nhru]\d+)$")
LAN_IFNAME = "lan"                        # a NAT router's bridge towards the nodes behind it
NAT_LAN = "192.168.{group}.0/24"          # the LAN behind NAT router <group - 1>: inside namespaces only


class NetnsUnavailable(RuntimeError):
    """This process cannot build namespaces here (not root, no `ip`, not Linux); str() says why."""


class NetnsError(RuntimeError):
    """A command building or removing the namespaces failed."""


def missing_privilege() -> str | None:
    """Why namespaces cannot be made here, or None if the prerequisites look fine."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux, this is {sys.platform}"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) not found on PATH"
    caps = _effective_caps()  # root in a container may lack them too
    missing = [name for bit, name in ((_CAP_NET_ADMIN, "CAP_NET_ADMIN"), (_CAP_SYS_ADMIN, "CAP_SYS_ADMIN"))
               if not caps >> bit & 1]
    if missing:
        return f"running as uid {os.geteuid()} without {' and '.join(missing)}"
    return None


def probe() -> str | None:
    """missing_privilege(), then really add and delete a namespace (containers may forbid it)."""
    reason = missing_privilege()
    if reason:
        return reason
    name = f"{PREFIX}probe{os.getpid() % 100000}"
    added = _ip("netns", "add", name, check=False)
    _ip("netns", "del", name, check=False)
    if added.returncode != 0:
        return f"`ip netns add` failed: {added.stderr.strip()}"
    return None


def _effective_caps() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    except OSError:
        pass
    return -1 if os.geteuid() == 0 else 0  # no /proc: trust root


def tbf_args(rate: float) -> list[str]:
    """`tc` arguments of a tbf qdisc capping a link at `rate` bytes/s (see TBF_* above)."""
    burst = max(TBF_MIN_BURST_BYTES, math.ceil(rate / TBF_HZ))
    return ["tbf", "rate", f"{round(rate * 8)}bit", "burst", str(burst), "latency", TBF_LATENCY]


def format_rate(rate: float) -> str:
    return f"{rate * 8 / 1e6:g}mbit ({rate / 1e6:.3g} MB/s)"


@dataclass(frozen=True)
class NetnsNode:
    rank: int
    namespace: str
    host_ifname: str
    address: str
    router: str = ""  # the namespace of the NAT router it sits behind ("": on the public bridge)


@dataclass(frozen=True)
class NatRouter:
    """A home router: its uplink on the run's bridge (`address`), a LAN bridge towards the nodes
    behind it; it masquerades what they send out and drops every connection opened from outside."""
    group: int
    namespace: str
    uplink_ifname: str  # the host end of its uplink veth, on the run's bridge
    address: str
    lan: ipaddress.IPv4Network


class NetnsCluster:
    """Bridge + one shaped namespace per rank for the lifetime of a `with` block.

    `bandwidth` (bytes/s, None = unshaped) caps each node's upload and, with `shape_ingress`,
    its download. `subnet` (a CIDR) overrides the automatic choice. `cluster_kwargs()` gives
    run_local_cluster what it needs to start the nodes inside.
    """

    def __init__(self, nodes: int, *, bandwidth: float | None = None, subnet: str | None = None,
                 shape_ingress: bool = True, run_id: str | None = None, stream: TextIO | None = None,
                 nat: tuple[tuple[int, ...], ...] = ()):
        if nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {nodes}")
        behind = [rank for group in nat for rank in group]
        if len(set(behind)) != len(behind) or not all(0 <= rank < nodes for rank in behind) or \
                any(not group for group in nat) or len(nat) > 250:
            raise ValueError(f"nat groups must be non-empty, disjoint sets of ranks below {nodes} (at most 250), "
                             f"got {nat!r}")
        if nat and shutil.which("nft") is None:
            raise NetnsUnavailable("NAT routers need `nft` (Debian package nftables), not found on PATH")
        self.nat = tuple(tuple(group) for group in nat)
        self.routers: list[NatRouter] = []
        if bandwidth is not None and not (bandwidth > 0 and math.isfinite(bandwidth)):
            raise ValueError(f"bandwidth must be a positive number of bytes/s, got {bandwidth!r}")
        if run_id is not None and not _RUN_ID.match(run_id):
            raise ValueError(f"run id must be 4 lowercase hex digits, got {run_id!r}")
        self.size = nodes
        self.bandwidth = bandwidth
        self.shape_ingress = shape_ingress
        self.stream = stream
        if subnet is None and nodes > 253:
            raise ValueError(f"{nodes} nodes do not fit the automatic /24 subnet: give a larger --netns-subnet")
        self._requested_subnet = parse_subnet(subnet, nodes) if subnet is not None else None
        self._requested_run_id = run_id
        self.run_id = ""
        self.bridge = ""
        self.subnet: ipaddress.IPv4Network | None = None
        self.bridge_address = ""
        self.nodes: list[NetnsNode] = []
        self._old_sigterm = None

    # lifecycle ------------------------------------------------------------------------------
    def __enter__(self) -> "NetnsCluster":
        reason = missing_privilege()
        if reason:
            raise NetnsUnavailable(f"--netns needs root or CAP_NET_ADMIN ({reason})")
        if self.bandwidth is not None and shutil.which("tc") is None:
            raise NetnsUnavailable("--bandwidth needs `tc` (iproute2), not found on PATH")
        try:
            sweep_stale()
        except NetnsError as exc:  # someone else's leftovers must not stop this run
            print(f"netns: warning: {exc}", file=self.stream or sys.stderr, flush=True)
        self._install_sigterm()
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Remove everything of this run; Ctrl-C / SIGTERM wait until it is done. Idempotent."""
        try:
            if self.run_id:
                with _signals_deferred():
                    remove_run(self.run_id)
        finally:
            self._restore_sigterm()

    def _install_sigterm(self) -> None:
        # SIGTERM would end Python without running `finally`; make it unwind like Ctrl-C does.
        if threading.current_thread() is threading.main_thread():
            self._old_sigterm = (signal.signal(signal.SIGTERM, _raise_exit),)

    def _restore_sigterm(self) -> None:
        if self._old_sigterm is not None:  # a 1-tuple: the old handler may itself be None
            signal.signal(signal.SIGTERM, self._old_sigterm[0] or signal.SIG_DFL)
            self._old_sigterm = None

    def _create(self) -> None:
        self.run_id = _claim_run_id(self._requested_run_id)  # the state file exists before any resource
        self.bridge = f"{PREFIX}br{self.run_id}"
        if self._requested_subnet is not None:
            check_free(self._requested_subnet)
        self.subnet = self._requested_subnet or pick_subnet(self.run_id)
        self.bridge_address = str(self.subnet.broadcast_address - 1)  # .254 of a /24; nodes from .1
        # routers on the bridge from .253 down (the bridge is .254, nodes from .1 up)
        self.routers = [NatRouter(g, f"{PREFIX}{self.run_id}r{g}", f"{PREFIX}{self.run_id}u{g}",
                                  str(self.subnet.broadcast_address - 2 - g),
                                  ipaddress.ip_network(NAT_LAN.format(group=g + 1))) for g in range(len(self.nat))]
        router_of = {rank: self.routers[g] for g, group in enumerate(self.nat) for rank in group}

        def address(rank: int) -> str:
            router = router_of.get(rank)
            if router is None:
                return str(self.subnet.network_address + rank + 1)
            return str(router.lan.network_address + 2 + self.nat[router.group].index(rank))

        self.nodes = [NetnsNode(rank, f"{PREFIX}{self.run_id}n{rank}", f"{PREFIX}{self.run_id}h{rank}", address(rank),
                                router=router_of[rank].namespace if rank in router_of else "")
                      for rank in range(self.size)]
        prefixlen = self.subnet.prefixlen
        _ip("link", "add", self.bridge, "type", "bridge", "forward_delay", "0")
        # Bridged frames must not pass through iptables (e.g. a FORWARD DROP policy set by docker).
        _ip("link", "set", self.bridge, "type", "bridge", "nf_call_iptables", "0", check=False)
        _ip("addr", "add", f"{self.bridge_address}/{prefixlen}", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for router in self.routers:
            self._create_router(router, prefixlen)
        for node in self.nodes:
            if node.router:
                self._create_behind_router(node, router_of[node.rank])
                continue
            _ip("netns", "add", node.namespace)
            _ip("link", "add", node.host_ifname, "type", "veth", "peer", "name", NS_IFNAME,
                "netns", node.namespace)
            _ip("link", "set", node.host_ifname, "master", self.bridge, "up")
            _ip("-n", node.namespace, "link", "set", "lo", "up")
            _ip("-n", node.namespace, "addr", "add", f"{node.address}/{prefixlen}", "dev", NS_IFNAME)
            _ip("-n", node.namespace, "link", "set", NS_IFNAME, "up")
            if self.bandwidth is not None:
                _run(["ip", "netns", "exec", node.namespace, "tc", "qdisc", "add", "dev", NS_IFNAME, "root",
                      *tbf_args(self.bandwidth)])
                if self.shape_ingress:
                    _run(["tc", "qdisc", "add", "dev", node.host_ifname, "root", *tbf_args(self.bandwidth)])
        if self.stream is not None:
            cap = "unshaped" if self.bandwidth is None else (
                f"{'upload and download' if self.shape_ingress else 'upload'} capped at "
                f"{format_rate(self.bandwidth)} by tc {' '.join(tbf_args(self.bandwidth))}")
            print(f"netns: {self.size} namespaces {self.nodes[0].namespace}..{self.nodes[-1].namespace} on bridge "
                  f"{self.bridge} ({self.bridge_address}), subnet {self.subnet}, {cap}", file=self.stream, flush=True)

    def _create_router(self, router: NatRouter, prefixlen: int) -> None:
        """The router's namespace: uplink on the bridge, LAN bridge, forwarding, NAT and firewall."""
        ns = router.namespace
        _ip("netns", "add", ns)
        _ip("link", "add", router.uplink_ifname, "type", "veth", "peer", "name", NS_IFNAME, "netns", ns)
        _ip("link", "set", router.uplink_ifname, "master", self.bridge, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "addr", "add", f"{router.address}/{prefixlen}", "dev", NS_IFNAME)
        _ip("-n", ns, "link", "set", NS_IFNAME, "up")
        _ip("-n", ns, "link", "add", LAN_IFNAME, "type", "bridge", "forward_delay", "0")
        _ip("-n", ns, "addr", "add", f"{router.lan.network_address + 1}/{router.lan.prefixlen}", "dev", LAN_IFNAME)
        _ip("-n", ns, "link", "set", LAN_IFNAME, "up")
        _run(["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.ip_forward=1"])
        for rule in nat_rules(NS_IFNAME, LAN_IFNAME):
            _run(["ip", "netns", "exec", ns, "nft", *rule])

    def _create_behind_router(self, node: NetnsNode, router: NatRouter) -> None:
        """A node on its router's LAN, the router its default gateway (no route in from outside)."""
        _ip("netns", "add", node.namespace)
        _ip("link", "add", node.host_ifname, "type", "veth", "peer", "name", NS_IFNAME, "netns", node.namespace)
        _ip("link", "set", node.host_ifname, "netns", router.namespace)
        _ip("-n", router.namespace, "link", "set", node.host_ifname, "master", LAN_IFNAME, "up")
        _ip("-n", node.namespace, "link", "set", "lo", "up")
        _ip("-n", node.namespace, "addr", "add", f"{node.address}/{router.lan.prefixlen}", "dev", NS_IFNAME)
        _ip("-n", node.namespace, "link", "set", NS_IFNAME, "up")
        _ip("-n", node.namespace, "route", "add", "default", "via", str(router.lan.network_address + 1))
        if self.bandwidth is not None:
            _run(["ip", "netns", "exec", node.namespace, "tc", "qdisc", "add", "dev", NS_IFNAME, "root",
                  *tbf_args(self.bandwidth)])

    # what the launcher needs ------------------------------------------------------------------
    @property
    def addresses(self) -> list[str]:
        return [node.address for node in self.nodes]

    def exec_prefix(self, rank: int) -> list[str]:
        """Run a command inside rank's namespace."""
        return ["ip", "netns", "exec", self.nodes[rank].namespace]

    def cluster_kwargs(self) -> dict:
        """Keyword arguments for run_local_cluster / plan_cluster: one address and one
        `ip netns exec` prefix per rank."""
        return {"hosts": self.addresses, "argv_prefixes": [self.exec_prefix(r) for r in range(self.size)]}


def nat_rules(uplink: str, lan: str) -> list[list[str]]:
    """`nft` commands of a home router: what the LAN sends out leaves with the uplink's address
    (masquerade), answers come back (connection tracking), and every connection opened from the
    uplink side, to the router or through it, is dropped."""
    return [
        ["add", "table", "ip", "p2pnat"],
        ["add", "chain", "ip", "p2pnat", "postrouting", "{ type nat hook postrouting priority srcnat ; }"],
        ["add", "rule", "ip", "p2pnat", "postrouting", "oifname", uplink, "masquerade"],
        ["add", "table", "inet", "p2pfirewall"],
        ["add", "chain", "inet", "p2pfirewall", "forward",
         "{ type filter hook forward priority filter ; policy drop ; }"],
        ["add", "rule", "inet", "p2pfirewall", "forward", "ct", "state", "established,related", "accept"],
        ["add", "rule", "inet", "p2pfirewall", "forward", "iifname", lan, "accept"],
        ["add", "chain", "inet", "p2pfirewall", "input", "{ type filter hook input priority filter ; policy drop ; }"],
        ["add", "rule", "inet", "p2pfirewall", "input", "ct", "state", "established,related", "accept"],
        ["add", "rule", "inet", "p2pfirewall", "input", "iifname", "{", lan, ",", "lo", "}", "accept"],
    ]


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)


class _signals_deferred:
    """Hold SIGINT / SIGTERM (main thread only) so a second Ctrl-C cannot cut a cleanup short;
    they are delivered when the block ends."""

    def __enter__(self):
        self._active = threading.current_thread() is threading.main_thread()
        if self._active:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})

    def __exit__(self, *exc):
        if self._active:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


# --- subnets -------------------------------------------------------------------------------------

def parse_subnet(text: str, nodes: int) -> ipaddress.IPv4Network:
    """A private IPv4 network with room for `nodes` and the bridge; ValueError says what is wrong."""
    try:
        subnet = ipaddress.IPv4Network(text, strict=False)
    except ValueError as exc:
        raise ValueError(f"--netns-subnet {text!r} is not an IPv4 network like 10.77.3.0/24: {exc}") from None
    if not subnet.is_private:
        raise ValueError(f"--netns-subnet {subnet} is not a private network (use 10/8, 172.16/12 or 192.168/16)")
    if subnet.num_addresses - 2 < nodes + 1:
        raise ValueError(f"--netns-subnet {subnet} has room for {max(0, subnet.num_addresses - 3)} nodes, "
                         f"need {nodes} (plus one address for the bridge)")
    return subnet


def check_free(subnet: ipaddress.IPv4Network) -> None:
    clash = [net for net in used_networks() if net.overlaps(subnet)]
    if clash:
        raise NetnsError(f"subnet {subnet} overlaps {', '.join(map(str, clash))}, already routed here")


_ROUTE_TYPES = {"unicast", "local", "broadcast", "multicast", "throw", "unreachable", "prohibit",
                "blackhole", "nat", "anycast"}


def used_networks() -> list[ipaddress.IPv4Network]:
    """Destinations of every IPv4 route of this machine (all tables), default routes left out."""
    lines = _ip("-4", "route", "show", "table", "all").stdout.splitlines()
    networks = []
    for line in lines:
        tokens = line.split()
        if tokens and tokens[0] in _ROUTE_TYPES:
            tokens = tokens[1:]
        if not tokens or tokens[0] == "default":
            continue
        try:
            networks.append(ipaddress.IPv4Network(tokens[0], strict=False))
        except ValueError:
            continue
    return networks


def pick_subnet(run_id: str) -> ipaddress.IPv4Network:
    """A 10.a.b.0/24 (a in SUBNET_FIRST_A..SUBNET_LAST_A) overlapping no route here; the search
    starts at an offset derived from the run id so concurrent runs rarely race for one."""
    used = used_networks()
    count = (SUBNET_LAST_A - SUBNET_FIRST_A + 1) * 256
    start = int(run_id, 16) % count
    for k in range(count):
        index = (start + k) % count
        subnet = ipaddress.IPv4Network(f"10.{SUBNET_FIRST_A + index // 256}.{index % 256}.0/24")
        if not any(subnet.overlaps(net) for net in used):
            return subnet
    raise NetnsError(f"no free /24 in 10.{SUBNET_FIRST_A}-{SUBNET_LAST_A}.x.0; pass --netns-subnet")


# --- run ownership and cleanup ------------------------------------------------------------------

def _process_start(pid: int) -> str | None:
    """Start time of a process in clock ticks since boot (tells a recycled pid apart)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _claim_run_id(requested: str | None) -> str:
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    owner = json.dumps({"pid": os.getpid(), "start": _process_start(os.getpid())})
    taken = set(owned_runs())
    for _ in range(100):
        run_id = requested or secrets.token_hex(2)
        if run_id in taken:
            if requested:
                raise NetnsError(f"netns run {run_id} already has namespaces or links here")
            continue
        try:
            with open(STATE_DIR / run_id, "x") as f:  # exclusive: two launchers never share an id
                f.write(owner)
            return run_id
        except FileExistsError:
            if requested:
                raise NetnsError(f"netns run {run_id} is in use (state file {STATE_DIR / run_id})") from None
    raise NetnsError("could not find a free netns run id")


def owned_runs() -> dict[str, list[str]]:
    """Run id -> the namespaces and host links named like ours (p2pbr<id>, p2p<id>n<i>, p2p<id>h<i>,
    and NAT routers' p2p<id>r<g>, p2p<id>u<g>)."""
    names = [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.strip()]
    names += [line.split(":")[1].strip().split("@")[0] for line in _ip("-o", "link", "show").stdout.splitlines()]
    runs: dict[str, list[str]] = {}
    for name in names:
        match = _OWNED.match(name)
        if match:
            runs.setdefault(match.group(1) or match.group(2), []).append(name)
    for state in STATE_DIR.glob("*") if STATE_DIR.is_dir() else ():
        if _RUN_ID.match(state.name):
            runs.setdefault(state.name, [])
    return runs


def run_is_live(run_id: str) -> bool:
    """True while the process that created the run still runs."""
    try:
        owner = json.loads((STATE_DIR / run_id).read_text())
    except (OSError, ValueError):
        return False
    return owner.get("start") is not None and _process_start(int(owner["pid"])) == owner["start"]


def remove_run(run_id: str) -> None:
    """Kill what still runs in the run's namespaces, delete its veths, namespaces and bridge,
    then its state file. Missing pieces are fine; anything else that fails raises NetnsError."""
    if not _RUN_ID.match(run_id):
        raise ValueError(f"run id must be 4 lowercase hex digits, got {run_id!r}")
    names = owned_runs().get(run_id, [])
    namespaces = [n for n in names if re.fullmatch(rf"{PREFIX}{run_id}[nr]\d+", n)]  # nodes, NAT routers
    errors = []
    for ns in namespaces:  # a namespace stays alive while a process is in it
        for pid in _ip("netns", "pids", ns, check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    for name in names:
        if name not in namespaces and re.fullmatch(rf"{PREFIX}{run_id}[hu]\d+", name):
            errors += _quiet(_ip("link", "del", name, check=False))  # deletes both veth ends
    for ns in namespaces:
        errors += _quiet(_ip("netns", "del", ns, check=False))
    if f"{PREFIX}br{run_id}" in names:
        errors += _quiet(_ip("link", "del", f"{PREFIX}br{run_id}", check=False))
    if errors:
        raise NetnsError(f"cleanup of netns run {run_id} incomplete:\n" + "\n".join(errors))
    try:
        (STATE_DIR / run_id).unlink()
    except FileNotFoundError:
        pass


def sweep_stale() -> list[str]:
    """Remove every run whose creator is gone (a SIGKILLed launcher); returns their ids. A state file
    per run under STATE_DIR names its owner; this runs at every start, or as
    ``python -m launcher.netns sweep``."""
    stale = [run_id for run_id in owned_runs() if not run_is_live(run_id)]
    for run_id in stale:
        remove_run(run_id)
    return stale


def _quiet(proc: subprocess.CompletedProcess) -> list[str]:
    """Errors of a removal, "already gone" not counted."""
    text = proc.stderr.strip()
    if proc.returncode == 0 or "Cannot find device" in text or "No such file" in text or "does not exist" in text:
        return []
    return [f"{' '.join(proc.args)}: {text}"]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run(["ip", *args], check=check)


def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        raise NetnsError(f"`{' '.join(argv)}` failed (exit {proc.returncode}): {proc.stderr.strip()}")
    return proc


# --- command line -------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.netns",
                                     description="Inspect and clean up p2ptrain network-namespace runs.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="runs with namespaces/links here, and whether their launcher lives")
    sub.add_parser("sweep", help="remove every run whose launcher is gone")
    cleanup = sub.add_parser("cleanup", help="remove the given runs, live or not")
    cleanup.add_argument("run_ids", nargs="+", metavar="RUN_ID")
    args = parser.parse_args(argv)
    reason = missing_privilege()
    if reason:
        print(f"launcher.netns: needs root or CAP_NET_ADMIN ({reason})", file=sys.stderr)
        return 1
    try:
        if args.command == "list":
            for run_id, names in sorted(owned_runs().items()):
                print(f"{run_id} {'live' if run_is_live(run_id) else 'stale'}: {' '.join(sorted(names)) or '-'}")
        elif args.command == "sweep":
            print(f"removed {len(removed := sweep_stale())} stale run(s) {' '.join(removed)}".rstrip())
        else:
            for run_id in args.run_ids:
                remove_run(run_id)
                print(f"removed run {run_id}")
    except (NetnsError, NetnsUnavailable, ValueError) as exc:
        print(f"launcher.netns: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
