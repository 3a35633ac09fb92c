"""What a node says about itself in every Hello, and checks its peers against: its id, the world
size, the protocol version and the fingerprint of the settings every node of a cluster must share.
Plain data."""
from __future__ import annotations

from dataclasses import dataclass

PROTOCOL_VERSION = "p2ptrain/1"


@dataclass(frozen=True)
class Identity:
    node_id: int
    world_size: int
    config_fingerprint: str = ""
    protocol_version: str = PROTOCOL_VERSION

    def compatibility(self, other_world: int, other_protocol: str, other_fingerprint: str) -> str:
        """Empty string when compatible, else the reason."""
        if other_protocol != self.protocol_version:  # (a peer's strings, shortened for logs)
            return f"protocol {other_protocol[:40]!r} != {self.protocol_version!r}"
        if other_world != self.world_size:
            return f"world size {other_world} != {self.world_size}"
        if other_fingerprint and self.config_fingerprint and other_fingerprint != self.config_fingerprint:
            return f"config fingerprint {other_fingerprint[:40]} != {self.config_fingerprint}"
        return ""


__all__ = ["Identity", "PROTOCOL_VERSION"]
