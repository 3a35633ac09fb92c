"""Rendezvous: how a node given no peer list learns every peer's gRPC address (and, when no launcher
gave it one, its rank) through a c10d key-value store, torch.distributed.TCPStore, that every node of
the run reaches: torchrun's own store, one someone started at the address named by --rendezvous, or
one a node hosts there when the address is its own and nothing answers at it yet (_connect).

Keys live under p2ptrain/<run id>/ (listed above KEY_PREFIX). A rank's address is set once (a second
claim of a rank fails), the nodes agree on world_size, and nobody goes on before every node has read
every address, so the process hosting the store never takes it away from a node still reading.
With a token every value is signed (tokenauth.sign_value) and an unsigned one is never used; without
one the store is unauthenticated. A hosted store listens on the --rendezvous host only. This module
never trains and never talks gRPC: node.py hands the addresses to the Transport once its server is
bound (Transport.set_peer_addresses), so the port published is the one the OS picked.
"""
from __future__ import annotations

import datetime
import errno
import ipaddress
import logging
import socket
import threading
import time
from typing import Any, Protocol

import torch.distributed as dist

from p2ptrain.addresses import host_of, is_wildcard, join_address, split_address, split_optional_port
from p2ptrain.transport.errors import PeerError
from p2ptrain.transport.security import read_token_file
from p2ptrain.transport.tokenauth import STORE_TAG, open_value, sign_value

log = logging.getLogger(__name__)

# Keys, under p2ptrain/<run id>/ (torchrun's agent keeps its own keys in the same store):
#   world_size      the run's node count, set by the first node; a node that says otherwise fails
#   next_rank       a counter (store.add): ranks for nodes given none, in arrival order
#   next_joiner     a counter: ranks world_size, world_size + 1, ... for nodes that join an elastic run later
#   address/<rank>  HOST:PORT of node <rank>, set once (compare_set): a second claim of a rank fails
# With a token, world_size and address/<rank> hold "p2ptrain-signed-v1 <mac> <value>" (the counters,
# store.add integers, cannot be signed: a stranger can disturb them, never name an address).
#   joined          a counter of nodes that have read every address: nobody goes on before all have,
#                   so the process hosting the store never takes it away from a node still reading
#   reachability/<rank>  "public", "private" or "unknown": whether peers could dial node <rank> back
#                   at its address (transport/reachability.py), set once its start-up check is done
KEY_PREFIX = "p2ptrain"   # then /<run id>/...
ANY_PORT_LISTEN = "[::]:0"  # a rendezvous node's default bind address: every interface, a port the OS picks
POLL_SECONDS = 0.05


class RendezvousSettings(Protocol):
    """What a rendezvous reads of a node's settings (NodeConfig's settings of these names)."""
    rank: int
    rank_given: bool       # False: the store assigns the rank
    world_size: int
    rendezvous: str | None  # HOST:PORT of the store
    advertise: str | None
    listen: str | None
    run_id: str
    peer_timeout: float    # bounds every wait: connecting, and for the other nodes
    rejoin: bool
    join: bool             # joins a running elastic run (a rank from world_size on)
    slots: int             # ranks the run may have: max_nodes in an elastic run, else world_size
    auth_token: str | None       # the run's shared secret: store values are signed with it
    auth_token_file: str | None

    def replace(self, **changes: Any) -> "RendezvousSettings":
        """A copy with `changes` (NodeConfig.replace)."""


class RendezvousError(PeerError):
    """The store is unreachable, or the nodes of a run disagree (world size, a rank claimed twice,
    more nodes than the world size); the message says which and what to do."""


def listen_address(config: RendezvousSettings) -> str:
    """Where a rendezvous node binds its gRPC server: --listen, else every interface on a free port."""
    return config.listen or ANY_PORT_LISTEN


def assign_rank(config: RendezvousSettings) -> RendezvousSettings:
    """`config` with a rank: its own when a source gave one, else the next one the store hands out."""
    if config.rank_given:
        return config
    store = _run_store(config)
    _agree_on_world_size(StoreEntries(store, config), config)
    if config.join:
        rank = config.world_size + store.add("next_joiner", 1) - 1
        if rank >= config.slots:
            raise RendezvousError(f"rendezvous {config.rendezvous} run {config.run_id!r}: no rank left to join: "
                                  f"--max-nodes is {config.slots}")
        log.info("rendezvous %s run %r: joining as rank %d", config.rendezvous, config.run_id, rank)
        return config.replace(rank=rank, rank_given=True)
    rank = store.add("next_rank", 1) - 1
    if rank >= config.world_size:
        raise RendezvousError(f"rendezvous {config.rendezvous} run {config.run_id!r}: more than {config.world_size} "
                              f"nodes asked for a rank (this is number {rank + 1}): a node started twice, --world-size "
                              "is too small, or an earlier run used this store and run id (give a new --run-id)")
    log.info("rendezvous %s run %r: the store assigned rank %d", config.rendezvous, config.run_id, rank)
    return config.replace(rank=rank, rank_given=True)


def exchange_addresses(config: RendezvousSettings, port: int) -> list[str]:
    """Publish this node's address (its gRPC server is bound to `port`) and return every node's, in
    rank order, once all `world_size` nodes have published theirs (and read them all). In an elastic
    run the list has a place per rank up to max_nodes: "" for a node that has not joined yet (its
    Hello names its address when it does)."""
    deadline = time.monotonic() + config.peer_timeout
    store = _run_store(config)
    entries = StoreEntries(store, config)
    _agree_on_world_size(entries, config)
    me = advertised_address(config, port)
    key = f"address/{config.rank}"
    if config.rejoin or config.join:  # a restarted node takes its rank back, at its new address
        entries.set(key, me)
    else:
        holder = entries.claim(key, me)
        if holder != me:
            raise RendezvousError(f"rendezvous {config.rendezvous} run {config.run_id!r}: rank {config.rank} claimed "
                                  f"twice: {holder} has it, so this node ({me}) cannot; give every node its own rank "
                                  "(--rank, RANK, SLURM_PROCID) or none at all, or a new --run-id for a new run")
    keys = [f"address/{rank}" for rank in range(config.world_size)]
    found: dict[str, str] = {}

    def read_all() -> bool:
        entries.read(key, own=me)  # (puts this node's entry back if a stranger overwrote it)
        for k in keys:
            if k not in found and (value := entries.read(k)) is not None:
                found[k] = value
        return len(found) == len(keys)

    _wait(read_all, deadline, lambda: _missing(config, keys, found, entries))
    addresses = [found[k] for k in keys]
    addresses += [entries.read(f"address/{rank}") or "" for rank in range(config.world_size, config.slots)]
    if not (config.rejoin or config.join):
        store.add("joined", 1)

        def all_joined() -> bool:
            entries.read(key, own=me)
            return store.add("joined", 0) >= config.world_size

        _wait(all_joined, deadline, lambda: (
            f"rendezvous {config.rendezvous} run {config.run_id!r}: after {config.peer_timeout:g}s only "
            f"{store.add('joined', 0)} of {config.world_size} nodes read the addresses"))
    log.info("node %d: rendezvous %s run %r: this node at %s; peers %s", config.rank, config.rendezvous,
             config.run_id, me, ",".join(addresses))
    return addresses


def publish_reachability(config: RendezvousSettings, value: str) -> None:
    """Say in the store whether peers can dial this node ("public" / "private" / "unknown"): its
    peers hear it in Hellos, a tool or a later joiner reads it here."""
    StoreEntries(_run_store(config), config).set(f"reachability/{config.rank}", value)


def read_reachability(config: RendezvousSettings, rank: int) -> str | None:
    """What node `rank` published about its reachability (None: nothing yet, or a forged entry)."""
    return StoreEntries(_run_store(config), config).read(f"reachability/{rank}")


def _missing(config: RendezvousSettings, keys: list[str], found: dict[str, str], entries: "StoreEntries") -> str:
    absent = [r for r, k in enumerate(keys) if k not in found and k not in entries.refused]
    refused = [r for r, k in enumerate(keys) if k not in found and k in entries.refused]
    problem = f"rendezvous {config.rendezvous} run {config.run_id!r}: after {config.peer_timeout:g}s "
    if refused:
        problem += (f"the address of rank(s) {refused} in the store is not signed with this node's auth token "
                    "(a stranger wrote it, or that node has another token)")
    if absent:
        problem += ("; " if refused else "") + f"no address from rank(s) {absent} of {config.world_size}"
    return problem


class StoreEntries:
    """The values p2ptrain writes to the run's store: signed with the token when one is set (and
    checked on every read: an unsigned or wrongly signed value is refused with a warning and never
    used), plain otherwise."""

    def __init__(self, store: dist.Store, config: RendezvousSettings):
        self.store = store
        self.config = config
        file = getattr(config, "auth_token_file", None)
        self._token = read_token_file(file) if file else getattr(config, "auth_token", None)
        self.refused: set[str] = set()  # keys whose value was refused (warned once each)

    def _seal(self, key: str, value: str) -> bytes:
        return sign_value(self._token, self.config.run_id, key, value) if self._token else value.encode()

    def _open(self, key: str, raw: bytes) -> str | None:
        """The value `raw` holds; None (with one warning per key) when it is not to be used."""
        if self._token:
            value = open_value(self._token, self.config.run_id, key, raw)
        elif raw.startswith(STORE_TAG + b" "):
            raise RendezvousError(f"rendezvous {self.config.rendezvous} run {self.config.run_id!r}: the store's "
                                  "entries are signed with an auth token: give this node the run's token")
        else:
            value = raw.decode(errors="replace")
        if value is None and key not in self.refused:
            self.refused.add(key)
            log.warning("rendezvous %s run %r: refused the store's %s: not signed with this node's auth token (a "
                        "stranger wrote it, or that node has another token)", self.config.rendezvous,
                        self.config.run_id, key)
        elif value is not None:
            self.refused.discard(key)
        return value

    def set(self, key: str, value: str) -> None:
        self.store.set(key, self._seal(key, value))

    def claim(self, key: str, value: str) -> str:
        """Set `key` to `value` unless it holds a valid value already; the value it holds after.
        A value that fails the check is no claim: it is replaced (atomically, compare_set)."""
        sealed, expected = self._seal(key, value), b""
        for _ in range(16):  # a stranger racing to rewrite it wins only this many times
            holder = self.store.compare_set(key, expected, sealed)
            if holder == sealed:
                return value
            held = self._open(key, holder)
            if held is not None:
                return held
            expected = holder
        raise RendezvousError(f"rendezvous {self.config.rendezvous} run {self.config.run_id!r}: the store's {key} "
                              "keeps being rewritten with values not signed with this node's auth token")

    def read(self, key: str, own: str | None = None) -> str | None:
        """The valid value of `key`; None if it has none yet. `own`: this node's value of a key it
        claimed: an invalid value found there is replaced with it."""
        if not self.store.check([key]):
            return None
        raw = self.store.get(key)
        value = self._open(key, raw)
        if value is None and own is not None:
            self.store.compare_set(key, raw, self._seal(key, own))
        return value


def advertised_address(config: RendezvousSettings, port: int) -> str:
    """HOST:PORT peers reach this node at: --advertise, else the host of --listen, else the local
    address of the interface that routes to the store (a UDP connect(), which sends nothing, then
    getsockname()), never a loopback address when the store is on another machine."""
    host, advertised_port = split_optional_port(config.advertise) if config.advertise is not None else (None, None)
    if host is None:
        listen_host = host_of(listen_address(config))
        if not is_wildcard(listen_host):
            host = listen_host
        else:
            host = default_advertise_host(*store_address(config))
    return join_address(host, advertised_port or port)


def default_advertise_host(store_host: str, store_port: int) -> str:
    """The local address of the interface that routes to the store. When the store's *name*
    resolves to loopback here (a hosts file mapping this machine's name to 127.0.1.1) other hosts
    still reach it by that name, so a non-loopback interface address is taken instead; loopback
    only when the store is named as loopback (127.0.0.1, ::1, localhost): a one-machine run."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(store_host, store_port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(sockaddr)  # UDP: picks the route and source address, sends nothing
            host = probe.getsockname()[0]
    except OSError as exc:
        raise RendezvousError(f"rendezvous store host {store_host!r}: no route to it ({exc}); set --advertise "
                              "HOST") from None
    if not ipaddress.ip_address(host.split("%")[0]).is_loopback or _names_loopback(store_host):
        return host
    others = non_loopback_addresses()
    if not others:
        raise RendezvousError(f"the rendezvous store {store_host!r} resolves to loopback ({host}) here, and this "
                              "machine has no other address to advertise: set --advertise HOST")
    return others[0]


def non_loopback_addresses() -> list[str]:
    """IPv4 addresses of this machine's interfaces, loopback left out (Linux: SIOCGIFADDR; else the
    addresses its host name resolves to)."""
    found: list[str] = []
    try:
        import fcntl
        import struct

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            for _, name in socket.if_nameindex():
                try:
                    packed = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
                except OSError:
                    continue  # no IPv4 address on it
                found.append(socket.inet_ntoa(packed[20:24]))
    except (ImportError, OSError):
        try:
            found = socket.gethostbyname_ex(socket.gethostname())[2]
        except OSError:
            found = []
    return [a for a in found if not ipaddress.ip_address(a).is_loopback]


def store_address(config: RendezvousSettings) -> tuple[str, int]:
    if config.rendezvous is None:
        raise RendezvousError("no rendezvous store configured (--rendezvous HOST:PORT)")
    address = split_address(config.rendezvous)
    if address is None:
        raise RendezvousError(f"rendezvous {config.rendezvous!r} is not HOST:PORT")
    return address


# --- the store ------------------------------------------------------------------------------------

_stores: dict[tuple[str, int], dist.Store] = {}  # one connection (or hosted server) per store and process,
_stores_lock = threading.Lock()                  # kept for the process's life: a hosted store must outlive
                                                 # every other node's reads


def _run_store(config: RendezvousSettings) -> dist.Store:
    """The store's keys of this run: p2ptrain/<run id>/..."""
    return dist.PrefixStore(f"{KEY_PREFIX}/{config.run_id}", _store(config))


def _store(config: RendezvousSettings) -> dist.Store:
    host, port = store_address(config)
    with _stores_lock:
        store = _stores.get((host, port))
        if store is None:
            store = _stores[(host, port)] = _connect(config, host, port)
        return store


def _connect(config: RendezvousSettings, host: str, port: int) -> dist.Store:
    """A connection to the store at host:port: torchrun's own (MASTER_ADDR:MASTER_PORT in its
    workers' environment) or one someone started there; or else this node hosts it, when the
    address is its own and nothing answers at it yet and this node is the rank-0 node (torch's
    env:// convention; a Slurm script points MASTER_ADDR at the first host, where task 0 runs) or a
    node whose rank the store will assign (the first to bind the port wins, as torchrun's c10d
    backend does)."""
    timeout = datetime.timedelta(seconds=config.peer_timeout)
    may_host = config.rank == 0 or not config.rank_given  # never a node whose rank says it is not first
    if may_host and _is_local(host) and not _answers(host, port):
        try:  # rank 0 (torch's env:// convention) or the first unranked node hosts, unless a store runs there
            store = _host_store(host, port, timeout)
            log.info("%s: hosting the rendezvous store on %s",
                     f"node {config.rank}" if config.rank_given else "this node", join_address(host, port))
            return store
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise RendezvousError(f"cannot host the rendezvous store on {host}:{port}: {exc}") from None
        except RuntimeError as exc:
            if "EADDRINUSE" not in str(exc) and errno.errorcode[errno.EADDRINUSE] not in str(exc):
                raise RendezvousError(f"cannot host the rendezvous store on {host}:{port}: "
                                      f"{_first_line(exc)}") from None
    try:
        return dist.TCPStore(host, port, is_master=False, timeout=timeout, wait_for_workers=False)
    except RuntimeError as exc:  # DistNetworkError / DistStoreError
        raise RendezvousError(f"rendezvous store {config.rendezvous} unreachable after {config.peer_timeout:g}s "
                              f"({_first_line(exc)}): is it running? torchrun runs one; otherwise the rank-0 node "
                              "hosts it when the address is its own") from None


def _host_store(host: str, port: int, timeout: datetime.timedelta) -> dist.Store:
    """A TCPStore server listening on `host` only (torch's own binds every interface): a socket
    bound here and handed over (master_listen_fd); a wildcard host listens everywhere, as asked."""
    infos = [] if is_wildcard(host) else socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    if not infos or (not _names_loopback(host) and all(_is_loopback(info[4][0]) for info in infos)):
        # A wildcard; or a machine name that resolves to loopback only here (a hosts file mapping it
        # to 127.0.1.1) while other machines reach it by that name: every interface, as asked / needed.
        if infos:
            log.warning("rendezvous store %s resolves to loopback here: hosting it on every interface", host)
        return dist.TCPStore(host, port, is_master=True, timeout=timeout, wait_for_workers=False)
    error: OSError | None = None
    for family, kind, proto, _, sockaddr in infos:
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(sockaddr)
            sock.listen(128)
        except OSError as exc:
            sock.close()
            error = exc if error is None or exc.errno == errno.EADDRINUSE else error
            continue
        try:
            store = dist.TCPStore(host, port, is_master=True, timeout=timeout, wait_for_workers=False,
                                  master_listen_fd=sock.fileno())
        except BaseException:
            sock.close()
            raise
        sock.detach()  # the store's server owns the socket from here
        return store
    raise error or OSError(errno.EADDRNOTAVAIL, f"no address of {host} can be bound")


def _agree_on_world_size(entries: StoreEntries, config: RendezvousSettings) -> None:
    said = entries.claim("world_size", str(config.world_size))
    if said != str(config.world_size):
        raise RendezvousError(f"rendezvous {config.rendezvous} run {config.run_id!r}: world size mismatch: this node "
                              f"says {config.world_size}, the run's first node said {said}")


def _wait(done, deadline: float, problem) -> None:
    while not done():
        if time.monotonic() >= deadline:
            raise RendezvousError(problem())
        time.sleep(POLL_SECONDS)


def _is_local(host: str) -> bool:
    """Whether `host` names this machine: one of its addresses can be bound."""
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.bind((sockaddr[0], 0))
                return True
        except OSError:
            continue
    return False


def _answers(host: str, port: int) -> bool:
    """Whether something already accepts connections there (torchrun's agent store, or a store
    someone started): then it is the store, and hosting another one beside it would split the run."""
    try:
        with socket.create_connection((host, port), timeout=2.0):
            return True
    except OSError:
        return False


def _names_loopback(host: str) -> bool:
    if host.lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


__all__ = ["RendezvousError", "RendezvousSettings", "advertised_address", "assign_rank", "default_advertise_host",
           "exchange_addresses", "listen_address", "non_loopback_addresses", "store_address"]
