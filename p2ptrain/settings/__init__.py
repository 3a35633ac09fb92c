"""A node's settings: NodeConfig, its groups and where settings come from.

  sections.py     the groups (cluster, training, data, transport, faults, security, output), each a
                  frozen dataclass declaring its settings once and checking them
  node_config.py  NodeConfig: the groups composed, flat access by setting name, cross-group checks
  sources.py      defaults < TOML < environment < flags, coercion, the launchers' environment
  parsers.py      the small languages inside settings ("0=4,3=2", "RANK@STEP", "0<->2:1", "1,2|any")

Importing it imports no torch and no gRPC (`p2ptrain --help` stays fast).
"""
from p2ptrain.settings.node_config import FINGERPRINT_SETTINGS, NodeConfig
from p2ptrain.settings.sections import (
    DEFAULT_ADAMW_LR,
    DEFAULT_LR,
    SECTIONS,
    SETTINGS,
    ConfigError,
    Setting,
)
from p2ptrain.settings.sources import env_variables

__all__ = ["DEFAULT_ADAMW_LR", "DEFAULT_LR", "FINGERPRINT_SETTINGS", "SECTIONS", "SETTINGS", "ConfigError",
           "NodeConfig", "Setting", "env_variables"]
