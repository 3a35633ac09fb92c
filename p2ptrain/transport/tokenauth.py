"""What the shared-secret token proves without ever being sent: per-call gRPC authorization values and
signed rendezvous-store entries (HMAC-SHA256 keyed by the token).

A call carries `P2P-HMAC 1 <sender> <receiver> <window> <nonce> <mac>`, the MAC covering the method,
both names, the time window and a fresh nonce: a receiver accepts only its own name, a window within
±1 of its own clock's (WINDOW_SECONDS each: clocks must agree to within one window) and a nonce it has
not seen (ReplayCache, bounded: full, it refuses). A captured value is thus worth one call of that
method to that receiver within about a minute, and nothing to anyone else. A store value is signed
over (run id, key, value), so a stranger who can write to the store cannot forge an entry. Every
comparison of secrets is constant-time; the token is never logged, printed or put in an error.
"""
from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time

SCHEME = "P2P-HMAC"
VERSION = "1"
WINDOW_SECONDS = 30          # a call is accepted in its sender's window and the receiver's ±1
NONCE_BYTES = 16
MAX_NONCES = 1 << 19         # nonces remembered at once (≈ 30 MB at most); beyond: refuse, never grow
STORE_TAG = b"p2ptrain-signed-v1"
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_HEX = re.compile(r"[0-9a-f]+")
_MAC_HEX = 2 * hashlib.sha256().digest_size


class CallRefused(Exception):
    """An authorization value that does not prove the token for this call; `reason` is one of
    missing, malformed, wrong_receiver, stale_window, bad_mac, replayed, replay_cache_full."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def check_name(name: str) -> str:
    """Sender and receiver names are short visible words (a rank, "ps")."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"an auth name must match {_NAME.pattern}, not {name!r}")
    return name


def current_window(now: float | None = None) -> int:
    return int((time.time() if now is None else now) // WINDOW_SECONDS)


def _call_mac(token: str, method: str, sender: str, receiver: str, window: str, nonce: str) -> str:
    message = "\n".join((SCHEME, VERSION, method, sender, receiver, window, nonce)).encode()
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


def authorization(token: str, method: str, sender: str, receiver: str, *, now: float | None = None,
                  nonce: str | None = None) -> str:
    """The authorization value for one call of `method` from `sender` to `receiver` (fresh nonce)."""
    window = str(current_window(now))
    nonce = nonce if nonce is not None else secrets.token_hex(NONCE_BYTES)
    mac = _call_mac(token, method, check_name(sender), check_name(receiver), window, nonce)
    return " ".join((SCHEME, VERSION, sender, receiver, window, nonce, mac))


class ReplayCache:
    """Nonces seen, one set per time window; windows the receiver no longer accepts are dropped.
    At most `cap` nonces at once: over it a call is refused (replay_cache_full), memory never grows."""

    def __init__(self, cap: int = MAX_NONCES):
        self.cap = cap
        self.size = 0
        self._seen: dict[int, set[int]] = {}

    def admit(self, window: int, nonce: bytes, now_window: int) -> None:
        for old in [w for w in self._seen if w < now_window - 1]:
            self.size -= len(self._seen.pop(old))
        key = int.from_bytes(nonce[:8], "big")  # 64 bits: a false "replayed" is ~1e-8 at the cap
        seen = self._seen.setdefault(window, set())
        if key in seen:
            raise CallRefused("replayed")
        if self.size >= self.cap:
            raise CallRefused("replay_cache_full")
        seen.add(key)
        self.size += 1


class CallVerifier:
    """The receiving side: checks one call's authorization value for receiver `name`."""

    def __init__(self, token: str, name: str, cache: ReplayCache | None = None):
        self._token = token
        self.name = check_name(name)
        self.cache = cache or ReplayCache()

    def verify(self, method: str, value: str | None, now: float | None = None) -> str:
        """The sender's name, or CallRefused saying why not."""
        if value is None:
            raise CallRefused("missing")
        parts = value.split(" ")
        if len(parts) != 7 or parts[0] != SCHEME or parts[1] != VERSION:
            raise CallRefused("malformed")
        _, _, sender, receiver, window, nonce, mac = parts
        if not (_NAME.fullmatch(sender) and _NAME.fullmatch(receiver) and window.isdigit() and len(window) <= 15
                and len(nonce) == 2 * NONCE_BYTES and _HEX.fullmatch(nonce)
                and len(mac) == _MAC_HEX and _HEX.fullmatch(mac)):
            raise CallRefused("malformed")
        if receiver != self.name:
            raise CallRefused("wrong_receiver")
        own = current_window(now)
        if abs(int(window) - own) > 1:
            raise CallRefused("stale_window")
        if not hmac.compare_digest(mac, _call_mac(self._token, method, sender, receiver, window, nonce)):
            raise CallRefused("bad_mac")
        self.cache.admit(int(window), bytes.fromhex(nonce), own)
        return sender


# -- rendezvous-store entries -------------------------------------------------------------------------
def _store_mac(token: str, run_id: str, key: str, value: bytes) -> bytes:
    message = b"\n".join((STORE_TAG, run_id.encode(), key.encode(), value))
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest().encode()


def sign_value(token: str, run_id: str, key: str, value: str) -> bytes:
    """`value` as stored under `key` of run `run_id`: tag, MAC, value."""
    raw = value.encode()
    return b" ".join((STORE_TAG, _store_mac(token, run_id, key, raw), raw))


def open_value(token: str, run_id: str, key: str, stored: bytes) -> str | None:
    """The value a signed entry holds; None when it is not signed with this token for this key and run."""
    parts = stored.split(b" ", 2)
    if len(parts) != 3 or parts[0] != STORE_TAG:
        return None
    if not hmac.compare_digest(parts[1], _store_mac(token, run_id, key, parts[2])):
        return None
    try:
        return parts[2].decode()
    except UnicodeDecodeError:
        return None


__all__ = ["CallRefused", "CallVerifier", "MAX_NONCES", "ReplayCache", "SCHEME", "WINDOW_SECONDS", "authorization",
           "check_name", "current_window", "open_value", "sign_value"]
