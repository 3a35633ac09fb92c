"""host:port addresses as the settings, the transport, the rendezvous and the launchers read them."""
from __future__ import annotations

import pytest

from p2ptrain.addresses import (
    WILDCARD_HOSTS,
    binds_both_families,
    host_of,
    is_host,
    is_host_port,
    is_wildcard,
    join_address,
    split_address,
    split_optional_port,
)


@pytest.mark.parametrize("address, parts", [
    ("127.0.0.1:50051", ("127.0.0.1", 50051)),
    ("node0:1", ("node0", 1)),
    ("[::1]:7000", ("::1", 7000)),
    ("[::]:0", ("::", 0)),       # a bind address: port 0 lets the OS pick
    ("::1:7000", None),          # an unbracketed IPv6 literal with a port is ambiguous
    ("unix:/tmp/s", None),
    ("host", None),
    (":5", None),
    ("host:http", None),
])
def test_split_address(address, parts):
    assert split_address(address) == parts


def test_join_brackets_ipv6_once_and_round_trips():
    assert join_address("::1", 5) == "[::1]:5" and join_address("[::1]", 5) == "[::1]:5"
    assert join_address("node7.example", "9") == "node7.example:9"
    for address in ("10.1.2.3:9999", "[fe80::1]:1", "a:1"):
        assert join_address(*split_address(address)) == address


def test_optional_port_and_host_of():
    assert split_optional_port("node7.example") == ("node7.example", None)
    assert split_optional_port("10.1.2.3:9999") == ("10.1.2.3", 9999)
    assert split_optional_port("::1") == ("::1", None) and split_optional_port("[::1]") == ("::1", None)
    assert split_optional_port("[::1]:8") == ("::1", 8)
    with pytest.raises(ValueError, match="not a number"):
        split_optional_port("host:http")
    assert host_of("[::1]:5") == "::1" and host_of("127.0.0.1:5") == "127.0.0.1" and host_of(":5") == ""


def test_hosts_and_host_ports():
    assert all(is_host(h) for h in ("localhost", "10.0.0.1", "::1", "[::1]", "0.0.0.0"))
    assert not any(is_host(h) for h in ("", "a b", "http://x", "127.0.0.1:9100", "a@b"))
    assert is_host_port("[::1]:1") and is_host_port("a:65535")
    assert not any(is_host_port(a) for a in ("a:0", "a:65536", "foo", "::1:5", "a b:1"))


def test_one_list_of_wildcards():
    assert set(WILDCARD_HOSTS) == {"", "*", "::", "0.0.0.0"}
    assert is_wildcard("[::]") and is_wildcard("0.0.0.0") and not is_wildcard("127.0.0.1")
    # IPv4's wildcard binds IPv4 alone; the others listen on IPv6 and IPv4, as the gRPC server does
    assert [h for h in ("", "*", "::", "[::]", "0.0.0.0", "::1") if binds_both_families(h)] == ["", "*", "::", "[::]"]
