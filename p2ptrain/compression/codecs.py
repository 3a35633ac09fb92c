"""Lossy tensor codecs for the wire, after Pipe-SGD (seed 004) and the compressed pseudo-gradients
of the DiLoCo family (OpenDiLoCo / INTELLECT-1: 16-bit and int8; Streaming DiLoCo: 4 bits;
DeMo / SparseLoCo: top-k with error feedback).

A codec turns a float32 tensor into a payload (the bytes that travel as TensorChunk data) plus a few
doubles (`codec_params` of the TensorHeader, e.g. the int8 scale); `header.codec` carries the codec's
`wire_id` (pb.CODEC_*). Every payload size is an exact function of the element count
(`payload_bytes`), which is what a receiver declares per channel; with error feedback, transmitted +
residual == input (`encode_with_feedback`). A NaN/Inf tensor is never encoded. Imports nothing from
the project but the generated proto enum; CODEC_NAMES lists the names without torch (see Codec).
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from p2ptrain._proto import p2ptrain_pb2 as pb


class CompressionError(ValueError):
    """A tensor cannot be encoded, or a payload/params pair cannot be decoded."""


@dataclass(frozen=True, eq=False)  # eq=False: comparing tensors elementwise has no truth value
class Encoded:
    """One encoded tensor: what goes on the wire plus what the receiver needs to rebuild it."""

    codec: int                      # pb.CODEC_*, travels as header.codec
    payload: torch.Tensor           # contiguous, on the input's device; its bytes are the chunk data
    params: tuple[float, ...]       # travel as header.codec_params
    dtype: torch.dtype              # decoded dtype
    shape: tuple[int, ...]          # decoded shape

    @property
    def nbytes(self) -> int:
        return self.payload.numel() * self.payload.element_size()


def _numel(shape) -> int:
    try:
        dims = tuple(int(d) for d in shape)
    except (TypeError, ValueError) as exc:
        raise CompressionError(f"shape must be a sequence of ints, got {shape!r}") from exc
    if any(d < 0 for d in dims):
        raise CompressionError(f"shape has a negative dimension: {dims}")
    return math.prod(dims)


def _reinterpret(payload: torch.Tensor, dtype: torch.dtype, expected_bytes: int, codec: str) -> torch.Tensor:
    """View the payload's raw bytes (any dtype, e.g. a uint8 wire buffer) as a flat `dtype` tensor."""
    if not isinstance(payload, torch.Tensor):
        raise CompressionError(f"{codec}: payload must be a torch.Tensor, got {type(payload).__name__}")
    nbytes = payload.numel() * payload.element_size()
    if nbytes != expected_bytes:
        raise CompressionError(f"{codec}: payload has {nbytes} bytes, expected {expected_bytes}")
    flat = payload.contiguous().reshape(-1)
    if flat.dtype == dtype:
        return flat
    try:
        return flat.view(torch.uint8).view(dtype)
    except RuntimeError:  # storage offset not aligned to the target element size
        return flat.clone().view(torch.uint8).view(dtype)


class Codec(ABC):
    """Encode a tensor for the wire and decode it back; stateless, so one instance is shared.

    Seed 004 compresses the exchanged tensors with "16-bit truncation (drop low mantissa bits)"
    (Trunc16) and "8-bit scalar quantization with range from the max |value|" (Int8Quantize).
    Everything is plain vectorized torch so it runs on whatever device the tensor lives on; the
    only host syncs are the finiteness check and reading the int8 scale, which must go into the
    header. The codec names are listed, without importing torch, in
    p2ptrain.compression.CODEC_NAMES (a test keeps the two in step)."""

    wire_id: int
    name: str
    param_count: int  # codec params that travel with a payload (header.codec_params)

    @abstractmethod
    def encode(self, tensor: torch.Tensor) -> Encoded: ...

    @abstractmethod
    def decode(self, payload: torch.Tensor, params: tuple[float, ...], shape,
               dtype: torch.dtype = torch.float32) -> torch.Tensor: ...

    @abstractmethod
    def payload_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        """Exact encoded byte count of a `dtype` tensor with `numel` elements (the lossy codecs
        encode float32 only)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, wire_id={self.wire_id})"

    # shared checks of the lossy codecs ------------------------------------------------------------
    def _check_input(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(contiguous float32 tensor, max |x| as a 0-d tensor); rejects NaN/Inf.

        max |x| is NaN or Inf exactly when some element is, and it is one cheap pass (about 10x
        faster than isfinite().all() on CPU), which matters on every all-reduce hop."""
        if not isinstance(tensor, torch.Tensor):
            raise CompressionError(f"{self.name}: expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype != torch.float32:
            raise CompressionError(f"{self.name}: only float32 tensors can be compressed, got {tensor.dtype}")
        tensor = tensor.detach().contiguous()
        if tensor.numel() == 0:
            return tensor, torch.zeros((), dtype=torch.float32, device=tensor.device)
        amax = tensor.abs().max()
        if not bool(torch.isfinite(amax)):
            bad = tensor.numel() - int(torch.isfinite(tensor).sum())
            raise CompressionError(f"{self.name}: cannot compress a tensor with NaN/Inf values "
                                   f"({bad} non-finite of {tensor.numel()})")
        return tensor, amax

    def _check_params(self, params, count: int) -> tuple[float, ...]:
        try:
            params = tuple(float(p) for p in params)
        except (TypeError, ValueError) as exc:
            raise CompressionError(f"{self.name}: codec params must be numbers, got {params!r}") from exc
        if len(params) != count:
            raise CompressionError(f"{self.name}: expected {count} codec param(s), got {len(params)}")
        return params

    def _check_dtype(self, dtype: torch.dtype) -> None:
        if not dtype.is_floating_point:
            raise CompressionError(f"{self.name}: can only decode to a floating dtype, got {dtype}")


class NoCompression(Codec):
    """Identity: the payload is the tensor itself, values untouched (any dtype)."""

    wire_id = pb.CODEC_NONE
    name = "none"
    param_count = 0

    def encode(self, tensor: torch.Tensor) -> Encoded:
        if not isinstance(tensor, torch.Tensor):
            raise CompressionError(f"none: expected a torch.Tensor, got {type(tensor).__name__}")
        tensor = tensor.detach().contiguous()
        return Encoded(self.wire_id, tensor.reshape(-1), (), tensor.dtype, tuple(tensor.shape))

    def decode(self, payload, params, shape, dtype=torch.float32):
        self._check_params(params, self.param_count)
        numel = _numel(shape)
        itemsize = torch.empty((), dtype=dtype).element_size()
        flat = _reinterpret(payload, dtype, numel * itemsize, self.name)
        return flat.reshape(tuple(int(d) for d in shape))

    def payload_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return dtype.itemsize * int(numel)


class Trunc16(Codec):
    """Seed 004 "16-bit truncation": keep the upper 16 bits of each float32 bit pattern.

    That is sign, the full 8-bit exponent and 7 mantissa bits, i.e. bfloat16 rounded toward
    zero (not to nearest): no overflow for any finite float32, |decoded| <= |x|, and relative
    error < 2^-7 for normal values. Done with int32 bit ops so it runs on any device. It was
    called "fp16" until that name went to real half precision (Fp16); its wire id never changed.
    """

    wire_id = pb.CODEC_TRUNC16
    name = "trunc16"
    param_count = 0

    def encode(self, tensor: torch.Tensor) -> Encoded:
        tensor, _ = self._check_input(tensor)
        bits = tensor.reshape(-1).view(torch.int32)
        # Arithmetic shift keeps the top half, sign-extended, so it fits int16 exactly.
        words = (bits >> 16).to(torch.int16)
        return Encoded(self.wire_id, words, (), torch.float32, tuple(tensor.shape))

    def decode(self, payload, params, shape, dtype=torch.float32):
        self._check_params(params, self.param_count)
        self._check_dtype(dtype)
        numel = _numel(shape)
        words = _reinterpret(payload, torch.int16, 2 * numel, self.name)
        # Multiply rather than `<<`: shifting negative ints is not defined everywhere; w * 2^16 for
        # w in [-2^15, 2^15) stays inside int32, and the low 16 bits come back as zeros.
        bits = words.to(torch.int32) * 65536
        out = bits.view(torch.float32).reshape(tuple(int(d) for d in shape))
        return out if dtype == torch.float32 else out.to(dtype)

    def payload_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return 2 * int(numel)


# Fp16's scale 2^e: e in [FP16_MIN_EXPONENT, FP16_MAX_EXPONENT], so that 2^e and 2^-e are both
# normal float32 numbers and scaling by either is exact (the largest float32, just under 2^128,
# gets e = 113).
FP16_MIN_EXPONENT, FP16_MAX_EXPONENT = -126, 113
# The largest float32 that half precision's 11 significant bits hold below 2^128: rounding anything
# above it to 11 bits gives 2^128, which float32 cannot hold, so larger magnitudes are clamped to it.
FP16_CLAMP = float.fromhex("0x1.ffcp+127")


class Fp16(Codec):
    """IEEE 754 half precision (binary16: 5-bit exponent, 10 mantissa bits), rounded to nearest
    even, of x / scale with one power-of-two scale per tensor.

    Half precision alone overflows above 65504 and goes subnormal below 2^-14 (6.1e-5), where
    gradients often live; so the scale 2^e puts max|x| / scale in [2^14, 2^15) (the top of half's
    range with headroom for rounding up), and since it is a power of two, dividing and multiplying
    by it are exact: decode(encode(x)) is x rounded to 11 significant bits wherever |x| >= max|x|
    2^-28, a relative error <= 2^-11 (trunc16 and bf16 keep 8 bits: 2^-7, 2^-8); below that half's
    subnormals take over, so |error| <= max(2^-11 |x|, 2^-39 max|x|) everywhere.
    The scale travels as the single codec param. Magnitudes above FP16_CLAMP (within 2^-11 of the
    largest float32) are clamped to it first; an all-zero tensor gets scale 1.
    """

    wire_id = pb.CODEC_FP16
    name = "fp16"
    param_count = 1

    @staticmethod
    def scale_exponent(amax: float) -> int:
        """e of the scale 2^e for a tensor whose max |x| is `amax`: amax / 2^e in [2^14, 2^15)."""
        if amax == 0:
            return 0
        _, exponent = math.frexp(amax)  # amax in [2^(exponent-1), 2^exponent)
        return min(max(exponent - 15, FP16_MIN_EXPONENT), FP16_MAX_EXPONENT)

    def encode(self, tensor: torch.Tensor) -> Encoded:
        tensor, amax = self._check_input(tensor)
        flat = tensor.reshape(-1)
        peak = float(amax)  # the host sync int8 has too: the scale goes into the header
        if peak > FP16_CLAMP:
            flat = flat.clamp(-FP16_CLAMP, FP16_CLAMP)
        exponent = self.scale_exponent(peak)
        # x * 2^-e is exact (both normal float32), so the one rounding is float32 -> float16
        words = flat.mul(2.0 ** -exponent).to(torch.float16).view(torch.int16)
        return Encoded(self.wire_id, words, (2.0 ** exponent,), torch.float32, tuple(tensor.shape))

    def decode(self, payload, params, shape, dtype=torch.float32):
        (scale,) = self._check_params(params, self.param_count)
        mantissa, exponent = math.frexp(scale) if math.isfinite(scale) else (0.0, 0)
        if mantissa != 0.5 or not FP16_MIN_EXPONENT <= exponent - 1 <= FP16_MAX_EXPONENT:
            raise CompressionError(f"fp16: scale must be a power of two in [2^{FP16_MIN_EXPONENT}, "
                                   f"2^{FP16_MAX_EXPONENT}], got {scale!r}")
        self._check_dtype(dtype)
        numel = _numel(shape)
        words = _reinterpret(payload, torch.int16, 2 * numel, self.name)
        out = words.view(torch.float16).to(torch.float32).mul_(scale).reshape(tuple(int(d) for d in shape))
        return out if dtype == torch.float32 else out.to(dtype)

    def payload_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return 2 * int(numel)


def _quotient(amax: torch.Tensor, levels: int) -> torch.Tensor:
    """amax / levels, correctly rounded on every device. (CUDA divides by a host scalar as a
    multiplication by its reciprocal, one ulp off for some values: a GPU node would then send a
    different scale, and different bytes, than a CPU node encoding the same tensor.)"""
    return amax / torch.full_like(amax, levels)


class Int8Quantize(Codec):
    """Seed 004 "8-bit scalar quantization with range from the max |value|".

    scale = max|x| / 127 and q = round(x / scale) in [-127, 127] (symmetric, -128 unused, so
    zero is exact); the scale travels as the single codec param. Error per element <= scale / 2.
    An all-zero tensor gets scale 0 and decodes to zeros without dividing by zero.
    """

    wire_id = pb.CODEC_INT8_QUANTIZE
    name = "int8"
    param_count = 1

    def encode(self, tensor: torch.Tensor) -> Encoded:
        tensor, amax = self._check_input(tensor)
        flat = tensor.reshape(-1)
        scale = _quotient(amax, 127)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # all zeros: x / 1 == 0
        # divide (not multiply by 1/scale: that overflows for subnormal scales); in-place passes
        q = flat.div(safe).round_().clamp_(-127, 127).to(torch.int8)
        # float32 scale read back as a double is exact, so decode multiplies by the very same value.
        return Encoded(self.wire_id, q, (float(scale),), torch.float32, tuple(tensor.shape))

    def decode(self, payload, params, shape, dtype=torch.float32):
        (scale,) = self._check_params(params, self.param_count)
        if not math.isfinite(scale) or scale < 0:
            raise CompressionError(f"int8: scale must be finite and >= 0, got {scale}")
        self._check_dtype(dtype)
        numel = _numel(shape)
        q = _reinterpret(payload, torch.int8, numel, self.name)
        out = q.to(torch.float32).mul_(scale)
        out = out.reshape(tuple(int(d) for d in shape))
        return out if dtype == torch.float32 else out.to(dtype)

    def payload_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return int(numel)


BF16_MAX = 3.3895313892515355e38  # the largest finite bfloat16


class Bf16Round(Codec):
    """bfloat16 rounded to nearest even (the 16-bit format OpenDiLoCo's pseudo-gradients use).

    Sign, 8-bit exponent and 7 mantissa bits, as Trunc16, but rounded to nearest instead of
    toward zero: relative error <= 2^-8 for normal values. Values beyond the largest bfloat16
    (which nearest rounding would turn into infinity) are clamped to it first.
    """

    wire_id = pb.CODEC_BF16
    name = "bf16"
    param_count = 0

    def encode(self, tensor: torch.Tensor) -> Encoded:
        tensor, amax = self._check_input(tensor)
        flat = tensor.reshape(-1)
        if tensor.numel() and float(amax) > BF16_MAX:
            flat = flat.clamp(-BF16_MAX, BF16_MAX)
        words = flat.to(torch.bfloat16).view(torch.int16)
        return Encoded(self.wire_id, words, (), torch.float32, tuple(tensor.shape))

    def decode(self, payload, params, shape, dtype=torch.float32):
        self._check_params(params, self.param_count)
        self._check_dtype(dtype)
        numel = _numel(shape)
        words = _reinterpret(payload, torch.int16, 2 * numel, self.name)
        out = words.view(torch.bfloat16).to(torch.float32).reshape(tuple(int(d) for d in shape))
        return out if dtype == torch.float32 else out.to(dtype)

    def payload_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return 2 * int(numel)


class Int4Quantize(Codec):
    """4-bit scalar quantization with range from the max |value| (Streaming DiLoCo sends its outer
    gradients in 4 bits; this is the uniform integer variant).

    scale = max|x| / 7 and q = round(x / scale) in [-7, 7]; q + 8 (1..15) is one nibble, two per
    byte, the element of even index in the low nibble; an odd count leaves the last high nibble 0.
    The scale travels as the single codec param. Error per element <= scale / 2. A nibble 0 (never
    produced) decodes to -8 scale, still finite and bounded.
    """

    wire_id = pb.CODEC_INT4_QUANTIZE
    name = "int4"
    param_count = 1
    LEVELS = 7

    def encode(self, tensor: torch.Tensor) -> Encoded:
        tensor, amax = self._check_input(tensor)
        flat = tensor.reshape(-1)
        scale = _quotient(amax, self.LEVELS)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = flat.div(safe).round_().clamp_(-self.LEVELS, self.LEVELS).add_(8).to(torch.uint8)
        if q.numel() % 2:
            q = torch.cat([q, q.new_zeros(1)])
        packed = q[0::2] | (q[1::2] << 4)
        return Encoded(self.wire_id, packed.contiguous(), (float(scale),), torch.float32, tuple(tensor.shape))

    def decode(self, payload, params, shape, dtype=torch.float32):
        (scale,) = self._check_params(params, self.param_count)
        if not math.isfinite(scale) or scale < 0:
            raise CompressionError(f"int4: scale must be finite and >= 0, got {scale}")
        self._check_dtype(dtype)
        numel = _numel(shape)
        packed = _reinterpret(payload, torch.uint8, self.payload_bytes(numel), self.name)
        q = torch.stack([packed & 15, packed >> 4], dim=1).reshape(-1)[:numel]
        out = q.to(torch.float32).sub_(8).mul_(scale).reshape(tuple(int(d) for d in shape))
        return out if dtype == torch.float32 else out.to(dtype)

    def payload_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return (int(numel) + 1) // 2


DEFAULT_TOPK_FRACTION = 0.01


class TopK(Codec):
    """Top-k sparsification (DeMo / SparseLoCo keep the largest entries of the pseudo-gradient and
    feed the rest back): the k = max(1, round(fraction * n)) entries of largest |x|, exact.

    Payload: k int32 indices in ascending order, then the k float32 values at them (8 k bytes, no
    codec params); the decoded tensor holds those values and zeros elsewhere. Decoding reads k off
    the payload size and refuses indices that are out of range or not strictly ascending (so no
    element is written twice) and non-finite values. Meant for error feedback: what it drops is
    everything but k entries.
    """

    wire_id = pb.CODEC_TOPK
    name = "topk"
    param_count = 0

    def __init__(self, fraction: float = DEFAULT_TOPK_FRACTION):
        if not (isinstance(fraction, (int, float)) and 0 < fraction <= 1):
            raise CompressionError(f"topk: the kept fraction must be in (0, 1], got {fraction!r}")
        self.fraction = float(fraction)

    def kept(self, numel: int) -> int:
        """k for a tensor of `numel` elements."""
        numel = int(numel)
        return 0 if numel == 0 else min(numel, max(1, round(self.fraction * numel)))

    def encode(self, tensor: torch.Tensor) -> Encoded:
        tensor, _ = self._check_input(tensor)
        flat = tensor.reshape(-1)
        k = self.kept(flat.numel())
        index = flat.abs().topk(k, sorted=False).indices.sort().values if k else flat.new_zeros(0, dtype=torch.long)
        values = flat[index]
        payload = torch.cat([index.to(torch.int32).view(torch.uint8), values.view(torch.uint8)])
        return Encoded(self.wire_id, payload, (), torch.float32, tuple(tensor.shape))

    def decode(self, payload, params, shape, dtype=torch.float32):
        self._check_params(params, self.param_count)
        self._check_dtype(dtype)
        numel = _numel(shape)
        if not isinstance(payload, torch.Tensor):
            raise CompressionError(f"topk: payload must be a torch.Tensor, got {type(payload).__name__}")
        nbytes = payload.numel() * payload.element_size()
        k = nbytes // 8
        if nbytes % 8 or k > numel or (numel and not k):
            raise CompressionError(f"topk: payload of {nbytes} bytes is not k index/value pairs for {numel} "
                                   f"elements (8 bytes each, 1 <= k <= {numel})")
        raw = _reinterpret(payload, torch.uint8, nbytes, self.name)
        index = _reinterpret(raw[:4 * k], torch.int32, 4 * k, self.name).to(torch.long)
        values = _reinterpret(raw[4 * k:], torch.float32, 4 * k, self.name)
        if k and (int(index[0]) < 0 or int(index[-1]) >= numel or not bool((index[1:] > index[:-1]).all())):
            raise CompressionError("topk: indices must be strictly ascending within [0, numel)")
        if k and not bool(torch.isfinite(values).all()):
            raise CompressionError("topk: non-finite values")
        out = torch.zeros(numel, dtype=torch.float32)
        out[index] = values
        out = out.reshape(tuple(int(d) for d in shape))
        return out if dtype == torch.float32 else out.to(dtype)

    def payload_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return 8 * self.kept(numel)

    def __repr__(self) -> str:
        return f"TopK(fraction={self.fraction:g}, wire_id={self.wire_id})"


CODECS: dict[str, Codec] = {"none": NoCompression(), "trunc16": Trunc16(), "fp16": Fp16(), "bf16": Bf16Round(),
                            "int8": Int8Quantize(), "int4": Int4Quantize(), "topk": TopK()}
_BY_WIRE_ID: dict[int, Codec] = {c.wire_id: c for c in CODECS.values()}


def get_codec(name_or_wire_id: str | int) -> Codec:
    """Look a codec up by config name (CODEC_NAMES) or by header wire id (pb.CODEC_*); top-k by name
    keeps DEFAULT_TOPK_FRACTION (see make_codec), and any top-k object decodes any top-k payload."""
    if isinstance(name_or_wire_id, str):
        codec = CODECS.get(name_or_wire_id.strip().lower())
        if codec is None:
            raise CompressionError(f"unknown codec {name_or_wire_id!r}; known: {sorted(CODECS)}")
        return codec
    if isinstance(name_or_wire_id, int) and not isinstance(name_or_wire_id, bool):
        codec = _BY_WIRE_ID.get(name_or_wire_id)
        if codec is None:
            raise CompressionError(f"unknown codec wire id {name_or_wire_id}; known: {sorted(_BY_WIRE_ID)}")
        return codec
    raise CompressionError(f"codec must be a name or a wire id, got {type(name_or_wire_id).__name__}")


def make_codec(name: str, *, topk_fraction: float | None = None) -> Codec:
    """The codec `name`; for "topk", one keeping `topk_fraction` of the entries (default
    DEFAULT_TOPK_FRACTION). Top-k's payload size depends on its kept fraction, so one codec object
    per fraction, while decoding reads k off the payload and needs none."""
    if name.strip().lower() == "topk" and topk_fraction is not None:
        return TopK(topk_fraction)
    return get_codec(name)


def encode_with_feedback(codec: Codec, tensor: torch.Tensor, residual: torch.Tensor) -> tuple[Encoded, torch.Tensor]:
    """Encode `tensor` and write into `residual` (same shape) what the encoding lost:
    residual = tensor - decoded. Returns (encoded, decoded); decoded + residual == tensor, exactly
    where the codec keeps an element or drops it whole (top-k), to float rounding otherwise. The
    caller keeps the residual on the node and adds it to what it encodes next (error feedback)."""
    encoded = codec.encode(tensor)
    if encoded.codec == NoCompression.wire_id:
        residual.zero_()
        return encoded, tensor
    decoded = codec.decode(encoded.payload, encoded.params, encoded.shape, torch.float32)
    torch.sub(tensor, decoded, out=residual)
    return encoded, decoded
