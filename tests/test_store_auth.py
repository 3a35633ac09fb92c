"""The rendezvous store nobody can forge (issue 23): with a token every value p2ptrain writes is signed
and checked on read, so a stranger who can write to the store cannot redirect a node (its entries
are refused with a warning and never used); and a store a node hosts listens on the --rendezvous
host only. A real TCPStore on loopback, written to by a raw store client as the stranger."""
from __future__ import annotations

import datetime
import logging
import socket
import threading

import pytest
import torch.distributed as dist

from p2ptrain.settings import NodeConfig
from p2ptrain.transport import rendezvous
from p2ptrain.transport.rendezvous import RendezvousError

TOKEN = "the-run-token-signs-the-store"
FORGED = "6.6.6.6:666"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def start_store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=10))


def settings(store_port: int, rank: int, run_id: str, **kw) -> NodeConfig:
    kw.setdefault("world_size", 2)
    kw.setdefault("auth_token", TOKEN)
    return NodeConfig(rendezvous=f"127.0.0.1:{store_port}", peer_timeout=kw.pop("timeout", 10.0), rank=rank,
                      run_id=run_id, **kw).validate()


def exchange_in_threads(configs_and_ports) -> dict[int, list[str] | BaseException]:
    results: dict[int, list[str] | BaseException] = {}

    def run(config, port):
        try:
            results[config.rank] = rendezvous.exchange_addresses(config, port)
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            results[config.rank] = exc

    threads = [threading.Thread(target=run, args=args) for args in configs_and_ports]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return results


def test_a_strangers_entries_are_refused_replaced_and_never_used(caplog):
    """Before: a stranger who wrote address/1 (and world_size) first had node 0 send it every Hello.
    Now its unsigned or wrongly signed values are no claim: node 1 replaces them, node 0 never uses
    them, and both warn."""
    store = start_store()
    run = "forged-first"
    store.set(f"p2ptrain/{run}/world_size", "2")
    store.set(f"p2ptrain/{run}/address/1", FORGED)
    with caplog.at_level(logging.WARNING, logger="p2ptrain.transport.rendezvous"):
        results = exchange_in_threads([(settings(store.port, 0, run), 7001), (settings(store.port, 1, run), 7002)])
    assert results[0] == results[1] == ["127.0.0.1:7001", "127.0.0.1:7002"], results
    assert "refused the store's address/1: not signed" in caplog.text
    assert "refused the store's world_size" in caplog.text
    assert TOKEN not in caplog.text
    raw = store.get(f"p2ptrain/{run}/address/1")
    assert raw.startswith(b"p2ptrain-signed-v1 ") and raw.endswith(b" 127.0.0.1:7002") and TOKEN.encode() not in raw


def test_an_entry_overwritten_after_it_was_published_is_put_back_by_its_owner():
    store = start_store()
    run = "forged-later"
    key = f"p2ptrain/{run}/address/1"
    results: dict = {}
    node1 = threading.Thread(target=lambda: results.update(
        exchange_in_threads([(settings(store.port, 1, run), 7002)])))
    node1.start()
    store.wait([key], datetime.timedelta(seconds=10))
    store.set(key, FORGED)  # node 1 published; a stranger overwrites it before node 0 reads
    results.update(exchange_in_threads([(settings(store.port, 0, run), 7001)]))
    node1.join(30)
    assert results[0] == results[1] == ["127.0.0.1:7001", "127.0.0.1:7002"], results


def test_a_node_waits_for_a_signed_entry_or_fails_in_one_line():
    store = start_store()
    run = "never-signed"
    store.set(f"p2ptrain/{run}/address/1", FORGED)  # node 1 never comes; only the stranger's value is there
    with pytest.raises(RendezvousError) as failed:
        rendezvous.exchange_addresses(settings(store.port, 0, run, timeout=1.0), 7001)
    message = str(failed.value)
    assert "\n" not in message and FORGED not in message and TOKEN not in message
    assert "rank(s) [1] in the store is not signed with this node's auth token" in message
    # A node with another token is refused just the same: its signature does not check out.
    run = "other-token"
    results = exchange_in_threads([(settings(store.port, 0, run, timeout=1.5), 7001),
                                   (settings(store.port, 1, run, timeout=1.5, auth_token="another-token"), 7002)])
    assert all(isinstance(r, RendezvousError) for r in results.values()), results


def test_without_a_token_signed_entries_ask_for_one():
    store = start_store()
    run = "mixed"
    exchange_in_threads([(settings(store.port, 0, run, world_size=1), 7001)])
    with pytest.raises(RendezvousError, match="signed with an auth token: give this node the run's token"):
        rendezvous.exchange_addresses(settings(store.port, 0, run, world_size=1, auth_token=None, rejoin=True), 7002)


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2.0):
            return True
    except OSError:
        return False


def test_a_hosted_store_listens_on_the_rendezvous_host_only():
    """Before: the store rank 0 hosts for --rendezvous 127.0.0.1:P listened on every interface.
    Now on 127.0.0.1 only: 127.0.0.2 (loopback too, another address) gets no answer."""
    port = free_port()
    config = settings(port, 0, "bound", world_size=1)
    assert rendezvous.exchange_addresses(config, 7005) == ["127.0.0.1:7005"]
    assert _reachable("127.0.0.1", port)
    assert not _reachable("127.0.0.2", port)
