"""Network addresses as the settings spell them: "host:port", "[v6]:port", bare hosts, wildcards.

The one place that splits, joins and checks them, so that settings, transport, rendezvous,
launchers and the parameter server agree on what an address is. An IPv6 literal carries brackets
inside an address ("[::1]:50051") and none as a bare host ("::1"); an unbracketed IPv6 literal with
a port ("::1:50051") is ambiguous and is never taken for host:port. Pure text: no sockets, no DNS.
"""
from __future__ import annotations

import ipaddress

# Every interface: a bind address meaning "all of them", never one a peer can be told to connect to.
IPV4_WILDCARD = "0.0.0.0"  # binds IPv4 alone; the others bind IPv6 and IPv4 (one port for both)
WILDCARD_HOSTS = ("", "*", "::", IPV4_WILDCARD)


def unbracket(host: str) -> str:
    """"[::1]" (the form inside an address) -> "::1" (the form sockets bind); others unchanged."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def join_address(host: str, port: int | str) -> str:
    """host:port, with brackets around an IPv6 literal (gRPC's and the settings' form)."""
    host = unbracket(host)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split_address(address: str) -> tuple[str, int] | None:
    """("host", port) of "host:port" / "[v6]:port" (host unbracketed; port 0 allowed, for binding);
    None for anything else: a bare host, an unbracketed IPv6 literal, unix:PATH."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host or "/" in host or host.startswith("unix"):
        return None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        return None
    return host, int(port)


def split_optional_port(text: str) -> tuple[str, int | None]:
    """"host:port" / "[v6]:port" -> (host, port); a bare host or IPv6 literal -> (host, None).
    Raises ValueError for a port that is not a number (e.g. "host:http")."""
    bracketed = text.startswith("[")
    if (bracketed and "]:" in text) or (not bracketed and text.count(":") == 1):
        host, _, port = text.rpartition(":")
        if not port.isdigit():
            raise ValueError(f"{text!r}: port {port!r} is not a number")
        return unbracket(host), int(port)
    return unbracket(text), None


def host_of(address: str) -> str:
    """The host of "host:port" / "[v6]:port", unbracketed ("" for ":port")."""
    return unbracket(address.rpartition(":")[0])


def is_host(text: str) -> bool:
    """A host name or IP literal (bracketed or not), not host:port: IPv6 is the only host with colons."""
    host = unbracket(text)
    if not host or any(c.isspace() or c in "/@" for c in host):
        return False
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return False
    return True


def is_port(port: int) -> bool:
    """A port a peer can connect to (1..65535)."""
    return 0 < port < 65536


def is_host_port(text: str) -> bool:
    """host:port a peer can connect to: a valid host (IPv6 in brackets) and a port in 1..65535."""
    parts = split_address(text)
    return parts is not None and is_host(parts[0]) and is_port(parts[1])


def is_wildcard(host: str) -> bool:
    """Whether `host` (bracketed or not) means every interface."""
    return unbracket(host) in WILDCARD_HOSTS


def binds_both_families(host: str) -> bool:
    """A wildcard that listens on IPv6 and IPv4 alike, as the gRPC server binds "[::]:port"."""
    return is_wildcard(host) and unbracket(host) != IPV4_WILDCARD


__all__ = ["IPV4_WILDCARD", "WILDCARD_HOSTS", "binds_both_families", "host_of", "is_host", "is_host_port",
           "is_port", "is_wildcard", "join_address", "split_address", "split_optional_port", "unbracket"]
