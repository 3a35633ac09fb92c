"""Lossy tensor codecs for the wire (seed 004: 16-bit truncation, 8-bit scalar quantization).

The codec names here import nothing heavy, so settings and `p2ptrain --help` can list them; the
codecs themselves (p2ptrain.compression.codecs) are plain vectorized torch and load on first use.
"""
from __future__ import annotations

import importlib
from typing import Any

CODEC_NAMES = ("none", "fp16", "int8")  # --compression values; codecs.CODECS holds one codec per name
UNCOMPRESSED = 0  # wire id of the identity codec (the wire's CODEC_NONE)

_FROM_CODECS = ("CODECS", "Codec", "CompressionError", "Encoded", "Fp16Truncate", "Int8Quantize", "NoCompression",
                "get_codec")


def __getattr__(name: str) -> Any:  # PEP 562: the codecs are imported (with torch) when first asked for
    if name in _FROM_CODECS:
        return getattr(importlib.import_module("p2ptrain.compression.codecs"), name)
    raise AttributeError(f"module 'p2ptrain.compression' has no attribute {name!r}")


__all__ = ["CODEC_NAMES", "UNCOMPRESSED", *_FROM_CODECS]
