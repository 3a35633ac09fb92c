"""Lossy tensor codecs for the wire (seed 004: 16-bit truncation, 8-bit scalar quantization; the
DiLoCo family's pseudo-gradients: bfloat16, 4-bit quantization and FP4 E3M0, top-k, SparseLoCo's
chunked top-k in 2 bits and DeMo's DCT top-k with error feedback; and IEEE half precision with a
per-tensor power-of-two scale).

The codec names here import nothing heavy, so settings and `p2ptrain --help` can list them; the
codecs themselves (p2ptrain.compression.codecs) are plain vectorized torch and load on first use.
"""
from __future__ import annotations

import importlib
from typing import Any

# --compression values; codecs.CODECS holds one codec per name (a test keeps the two in step)
CODEC_NAMES = ("none", "trunc16", "fp16", "bf16", "int8", "int4", "topk", "sparseloco", "dct-topk", "fp4")
UNCOMPRESSED = 0  # wire id of the identity codec (the wire's CODEC_NONE)
VOID = 11  # wire id of a header-only push-sum void notice, weight 0 and no payload (the wire's CODEC_VOID)
CODEC_HELP = ("codec of every ring hop (each decompresses, sums, recompresses): trunc16 = 16-bit truncation "
              "(bfloat16 rounded toward zero), fp16 = IEEE half precision of x / a power-of-two scale, bf16 = "
              "bfloat16 rounded to nearest, int8 / int4 = 8- / 4-bit scalar quantization (scale max|x|/127, /7), "
              "fp4 = 4-bit floats E3M0 (sign, 3 exponent bits, scale max|x|), topk = the --topk-fraction largest "
              "entries, sparseloco = the --topk-fraction largest of each 4096-entry chunk in --value-bits bits, "
              "dct-topk = the same of the DCT coefficients of each 256-entry chunk (topk, sparseloco and "
              "dct-topk: diloco, which keeps what a codec drops on the node as error feedback and exchanges "
              "them by all-gather, see --sparse-exchange; sparseloco and dct-topk also gossip-diloco, on the "
              "pseudo-gradient half of its shares, the anchors going int8)")
# codecs that drop most of a tensor: only for algorithms that keep what they drop (error feedback)
NEEDS_ERROR_FEEDBACK = ("topk", "sparseloco", "dct-topk")
# --value-bits of sparseloco / dct-topk (32: float32 values); codecs.VALUE_BITS (a test keeps them in step)
VALUE_BITS = (1, 2, 3, 4, 5, 6, 7, 8, 32)

_FROM_CODECS = ("CODECS", "Bf16Round", "Codec", "CompressionError", "DctTopK", "Encoded", "Fp4", "Fp16", "Halves",
                "Int4Quantize", "Int8Quantize", "NoCompression", "SparseLoCo", "TopK", "Trunc16", "dct_basis",
                "encode_with_feedback", "get_codec", "make_codec")


def __getattr__(name: str) -> Any:  # PEP 562: the codecs are imported (with torch) when first asked for
    if name in _FROM_CODECS:
        return getattr(importlib.import_module("p2ptrain.compression.codecs"), name)
    raise AttributeError(f"module 'p2ptrain.compression' has no attribute {name!r}")


__all__ = ["CODEC_HELP", "CODEC_NAMES", "NEEDS_ERROR_FEEDBACK", "UNCOMPRESSED", "VALUE_BITS", *_FROM_CODECS]
