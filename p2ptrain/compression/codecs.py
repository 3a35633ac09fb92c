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
        if not math.isfinite(amax.item()):  # (one sync either way; torch.isfinite on a 0-d tensor is ~30x slower)
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


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """4-bit codes (uint8, < 16) two per byte, the even index in the low nibble."""
    if q.numel() % 2:
        q = torch.cat([q, q.new_zeros(1)])
    return (q[0::2] | (q[1::2] << 4)).contiguous()


def _unpack_nibbles(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The first `numel` 4-bit codes of `packed` (_pack_nibbles' inverse), as uint8."""
    return torch.stack([packed & 15, packed >> 4], dim=1).reshape(-1)[:numel]


def _check_scale(codec: str, scale: float) -> None:
    if not math.isfinite(scale) or scale < 0:
        raise CompressionError(f"{codec}: scale must be finite and >= 0, got {scale}")


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
        _check_scale("int8", scale)
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
        return Encoded(self.wire_id, _pack_nibbles(q), (float(scale),), torch.float32, tuple(tensor.shape))

    def decode(self, payload, params, shape, dtype=torch.float32):
        (scale,) = self._check_params(params, self.param_count)
        _check_scale("int4", scale)
        self._check_dtype(dtype)
        numel = _numel(shape)
        packed = _reinterpret(payload, torch.uint8, self.payload_bytes(numel), self.name)
        q = _unpack_nibbles(packed, numel)
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


DEFAULT_VALUE_BITS = 2
FLOAT_VALUES = 32  # value_bits that sends the kept values as float32, unquantized
VALUE_BITS = (*range(1, 9), FLOAT_VALUES)


def _levels(bits: int, device) -> torch.Tensor:
    """The 2^b values (2c - L) / L, L = 2^b - 1, of the b-bit codes c: 2^b levels evenly spaced over
    [-1, 1], no zero among them (mid-rise). Divided tensor by tensor, so correctly rounded on every
    device (see _quotient)."""
    top = (1 << bits) - 1
    codes = torch.arange(top + 1, dtype=torch.float32, device=device)
    return codes.mul(2).sub_(top).div_(torch.full_like(codes, top))


def _pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """b-bit codes (any int dtype) as a bit stream, least significant bit first: ceil(n b / 8) bytes."""
    if bits == 8:
        return codes.to(torch.uint8)
    shifts = torch.arange(bits, dtype=torch.int32, device=codes.device)
    stream = ((codes.to(torch.int32).unsqueeze(1) >> shifts) & 1).reshape(-1)
    stream = torch.cat([stream, stream.new_zeros(-stream.numel() % 8)])
    weights = torch.arange(8, dtype=torch.int32, device=codes.device)
    return (stream.reshape(-1, 8) << weights).sum(dim=1, dtype=torch.int32).to(torch.uint8)


def _unpack_bits(packed: torch.Tensor, count: int, bits: int) -> torch.Tensor:
    """The `count` b-bit codes of a _pack_bits stream, as int64."""
    if bits == 8:
        return packed.to(torch.long)
    shifts = torch.arange(8, dtype=torch.int32, device=packed.device)
    stream = ((packed.to(torch.int32).unsqueeze(1) >> shifts) & 1).reshape(-1)[:count * bits]
    weights = torch.arange(bits, dtype=torch.int32, device=packed.device)
    return (stream.reshape(count, bits) << weights).sum(dim=1).to(torch.long)


class _ChunkedTopK(Codec):
    """Per-chunk top-k of a (transformed) flat tensor, the values quantized to b bits with one scale
    per chunk: what SparseLoCo and DCT top-k share (their docstrings give the layout).

    The flat tensor is cut into chunks of CHUNK elements, the last one shorter where CHUNK does not
    divide n; chunk i of len_i elements keeps k_i = ceil(f len_i) entries (at least 1), ascending by
    index. Values: b <= 8: code c = the nearest of the 2^b levels (2c - L) / L of v / s (L = 2^b - 1,
    s = the chunk's max |kept|), so |v - decoded| <= s / L, half the spacing of the levels; b = 32:
    the float32 values, exact. The decoder reads f and b from the codec params (any codec object
    decodes any payload), and refuses sizes, scales, values and indices the encoder never sends.
    Error feedback: a dropped entry goes whole into the residual; x - decoded of a kept one is
    exact (Sterbenz) where |x| >= s / (2 L), e.g. on dense chunks at b >= 2, else one rounding."""

    param_count = 2  # [f, b]
    CHUNK: int
    INDEX_DTYPE: torch.dtype

    def __init__(self, fraction: float = DEFAULT_TOPK_FRACTION, value_bits: int = DEFAULT_VALUE_BITS):
        self.fraction = self._fraction(fraction)
        self.value_bits = self._bits(value_bits)

    # the transform of a (rows, length) block of chunks and the inverse of its kept coefficients
    def _forward(self, chunks: torch.Tensor) -> torch.Tensor:
        return chunks

    @abstractmethod
    def _inverse(self, index: torch.Tensor, values: torch.Tensor, length: int) -> torch.Tensor:
        """(rows, length) chunks from the (rows, k) ascending indices and values kept of each."""

    # checks ----------------------------------------------------------------------------------------
    def _fraction(self, fraction) -> float:
        if not (isinstance(fraction, (int, float)) and not isinstance(fraction, bool) and 0 < fraction <= 1):
            raise CompressionError(f"{self.name}: the kept fraction must be in (0, 1], got {fraction!r}")
        return float(fraction)

    def _bits(self, bits) -> int:
        if isinstance(bits, float) and bits.is_integer():
            bits = int(bits)
        if isinstance(bits, bool) or bits not in VALUE_BITS:
            raise CompressionError(f"{self.name}: value bits must be 1..8 or {FLOAT_VALUES} (float32 values), "
                                   f"got {bits!r}")
        return int(bits)

    # sizes -----------------------------------------------------------------------------------------
    def kept(self, length: int, fraction: float | None = None) -> int:
        """k of a chunk of `length` elements: ceil(f length), at least 1 (0 for an empty chunk)."""
        fraction = self.fraction if fraction is None else fraction
        return 0 if length <= 0 else min(length, max(1, math.ceil(fraction * length)))

    def groups(self, numel: int, fraction: float | None = None) -> list[tuple[int, int, int]]:
        """(chunks, length, k) of the full chunks and of the shorter last one, in chunk order."""
        numel = int(numel)
        full, tail = divmod(numel, self.CHUNK)
        out = [(full, self.CHUNK, self.kept(self.CHUNK, fraction))] if full else []
        return out + [(1, tail, self.kept(tail, fraction))] if tail else out

    def _sizes(self, numel: int, fraction: float, bits: int) -> tuple[int, int, int, int]:
        """(chunks, K, bytes of the scales or float values, bytes of the codes) of a payload."""
        groups = self.groups(numel, fraction)
        chunks, total = sum(g[0] for g in groups), sum(g[0] * g[2] for g in groups)
        if bits == FLOAT_VALUES:
            return chunks, total, 4 * total, 0
        return chunks, total, 4 * chunks, (total * bits + 7) // 8

    def payload_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        _, total, floats, codes = self._sizes(numel, self.fraction, self.value_bits)
        return floats + total * self.INDEX_DTYPE.itemsize + codes

    # encode / decode -------------------------------------------------------------------------------
    def encode(self, tensor: torch.Tensor) -> Encoded:
        tensor, _ = self._check_input(tensor)
        flat, bits = tensor.reshape(-1), self.value_bits
        start, indices, values, scales, codes = 0, [], [], [], []
        for rows, length, k in self.groups(flat.numel()):
            block = self._forward(flat[start:start + rows * length].reshape(rows, length))
            start += rows * length
            index = block.abs().topk(k, dim=1, sorted=False).indices.sort(dim=1).values
            kept = block.gather(1, index)
            indices.append(index.reshape(-1))
            if bits == FLOAT_VALUES:
                values.append(kept.reshape(-1))
                continue
            scale = kept.abs().amax(dim=1, keepdim=True)
            safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero chunk: codes of 0 / 1
            top = (1 << bits) - 1
            # nearest level: c = floor(((v / s + 1) L + 1) / 2), in [0, L]
            code = kept.div(safe).add_(1).mul_(top).add_(1).mul_(0.5).floor_().clamp_(0, top)
            scales.append(scale.reshape(-1))
            codes.append(code.reshape(-1).to(torch.uint8))
        empty = flat.new_zeros(0)
        index = torch.cat(indices).to(self.INDEX_DTYPE) if indices else empty.to(self.INDEX_DTYPE)
        if bits == FLOAT_VALUES:
            head = torch.cat(values) if values else empty
            tail = empty.to(torch.uint8)
        else:
            head = torch.cat(scales) if scales else empty
            tail = _pack_bits(torch.cat(codes), bits) if codes else empty.to(torch.uint8)
        payload = torch.cat([head.view(torch.uint8), index.view(torch.uint8), tail])
        return Encoded(self.wire_id, payload, (self.fraction, float(bits)), torch.float32, tuple(tensor.shape))

    def decode(self, payload, params, shape, dtype=torch.float32):
        fraction, bits = self._check_params(params, self.param_count)
        fraction, bits = self._fraction(fraction), self._bits(bits)
        self._check_dtype(dtype)
        numel = _numel(shape)
        _, total, floats, code_bytes = self._sizes(numel, fraction, bits)
        index_bytes = total * self.INDEX_DTYPE.itemsize
        raw = _reinterpret(payload, torch.uint8, floats + index_bytes + code_bytes, self.name)
        head = _reinterpret(raw[:floats], torch.float32, floats, self.name)  # scales, or float32 values
        index = _reinterpret(raw[floats:floats + index_bytes], self.INDEX_DTYPE, index_bytes, self.name).to(torch.long)
        if bits == FLOAT_VALUES:
            if not bool(torch.isfinite(head).all()):
                raise CompressionError(f"{self.name}: non-finite values")
        else:
            if not bool(torch.isfinite(head).all()) or bool((head < 0).any()):
                raise CompressionError(f"{self.name}: chunk scales must be finite and >= 0")
            code = _unpack_bits(raw[floats + index_bytes:], total, bits)
            levels = _levels(bits, raw.device)
        out, at, chunk = [], 0, 0  # at: first kept entry of the group, chunk: its first chunk
        for rows, length, k in self.groups(numel, fraction):
            block = index[at:at + rows * k].reshape(rows, k)
            if bool((block < 0).any()) or bool((block >= length).any()) or bool((block[:, 1:] <= block[:, :-1]).any()):
                raise CompressionError(f"{self.name}: indices must be strictly ascending within [0, {length}) "
                                       f"in each chunk")
            if bits == FLOAT_VALUES:
                values = head[at:at + rows * k].reshape(rows, k)
            else:
                values = levels[code[at:at + rows * k].reshape(rows, k)].mul_(head[chunk:chunk + rows].unsqueeze(1))
            out.append(self._inverse(block, values, length).reshape(-1))
            at, chunk = at + rows * k, chunk + rows
        result = torch.cat(out) if out else torch.zeros(0, dtype=torch.float32, device=raw.device)
        result = result.reshape(tuple(int(d) for d in shape))
        return result if dtype == torch.float32 else result.to(dtype)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(fraction={self.fraction:g}, value_bits={self.value_bits}, "
                f"wire_id={self.wire_id})")


class SparseLoCo(_ChunkedTopK):
    """SparseLoCo (Sarfi et al. 2025, arXiv 2508.15706): the pseudo-gradient Δ is cut into chunks of
    4096 entries, each chunk keeps its top-k by |Δ| and sends them as 2-bit values (--value-bits)
    with one scale per chunk; what it drops stays on the node (error feedback: e ← Δ + e - decoded).
    Chunks make the indices 12-bit (sent as int16) and the top-k selection local and parallel.

    Payload (K = Σ k_i, m chunks; codec params [f, b]): b <= 8: m float32 scales s_i = max |kept|
    of chunk i, K int16 indices within their chunk, then the K b-bit codes packed least significant
    bit first into ceil(K b / 8) bytes; b = 32: K float32 values, then the K int16 indices. 2 bits at
    f = 0.01: 97 bytes per 4096 entries, 1/169 of float32. Kept entries decode to (2c - L) / L s_i,
    within s_i / (2^b - 1) of the truth (levels ±1.5 and ±0.5 times 2 s_i / 3 at 2 bits); dropped
    ones to exactly 0. A kept entry that is 0 decodes to ±s_i / L (no zero level): its error goes
    back with the residual. Meant for error feedback: it drops all but ~f of the tensor."""

    wire_id = pb.CODEC_SPARSELOCO
    name = "sparseloco"
    CHUNK = 4096
    INDEX_DTYPE = torch.int16

    def _inverse(self, index, values, length):
        out = torch.zeros(index.shape[0], length, dtype=torch.float32, device=values.device)
        return out.scatter_(1, index, values)


_DCT_CACHE: dict[tuple[int, str], torch.Tensor] = {}


def dct_basis(length: int, device=None) -> torch.Tensor:
    """The orthonormal DCT-II matrix D (length x length, float32): X = D x, x = Dᵀ X. Row k is
    s_k cos(π (n + 1/2) k / N), s_0 = sqrt(1/N), s_k = sqrt(2/N). Computed in float64 on the CPU and
    rounded once, so it has the same bits on every device (decoders agree bit for bit); cached."""
    device = torch.device("cpu") if device is None else torch.device(device)
    key = (int(length), str(device))
    basis = _DCT_CACHE.get(key)
    if basis is None:
        n = torch.arange(length, dtype=torch.float64)
        basis = torch.cos(math.pi * (n + 0.5).unsqueeze(0) * n.unsqueeze(1) / length) * math.sqrt(2.0 / length)
        basis[0] *= math.sqrt(0.5)
        if len(_DCT_CACHE) >= 64:  # tail lengths differ per tensor size; a run has a handful
            _DCT_CACHE.clear()
        basis = _DCT_CACHE[key] = basis.to(torch.float32).to(device)
    return basis


class DctTopK(_ChunkedTopK):
    """DeMo's transmission (Peng et al. 2024, arXiv 2411.19870): chunks of 256 entries go through
    the orthonormal DCT-II and keep their k = ceil(f 256) largest coefficients, since the fast
    moving, highly correlated components concentrate in a few DCT frequencies; the rest stays on
    the node (error feedback). DeMo chunks 2-D tensors; a flat vector gets 1-D chunks (the last one
    shorter, with its own basis). The payload is SparseLoCo's with uint8 indices (0..255) and DCT
    coefficients for values; --value-bits 1 is DeMo's sign variant (±s_i per kept coefficient),
    32 sends the coefficients as float32. Encoding is a matmul with the cached basis D; decoding
    adds, for each of the k kept coefficients in turn, v · D[index] (k elementwise passes, no
    matmul, whose summation order differs by device): the same bytes decode to the same bits on
    a CPU and on a GPU, so DiLoCo nodes stay in step. Coefficient errors are SparseLoCo's bound;
    the decoded chunk's L2 error is that of the coefficients (D is orthonormal)."""

    wire_id = pb.CODEC_DCT_TOPK
    name = "dct-topk"
    CHUNK = 256
    INDEX_DTYPE = torch.uint8

    def _forward(self, chunks):
        return chunks @ dct_basis(chunks.shape[1], chunks.device).T

    def _inverse(self, index, values, length):
        basis = dct_basis(length, values.device)
        out = torch.zeros(index.shape[0], length, dtype=torch.float32, device=values.device)
        for j in range(index.shape[1]):
            out.add_(basis[index[:, j]].mul_(values[:, j:j + 1]))
        return out


# FP4 E3M0 magnitudes: code e = 0 is zero, e = 1..7 is 2^(e-7) times the scale (2^-6 .. 1)
FP4_MIN_EXPONENT = -6


class Fp4(Codec):
    """4-bit floating point E3M0 (Streaming DiLoCo sends its outer gradients in 4 bits, as 1 sign,
    3 exponent and no mantissa bits): x ≈ ±s 2^(e-7), s = max|x| per tensor (the one codec param).

    A nibble is sign << 3 | e: e = 0 is zero (sign 0 from the encoder; sign 1 also decodes to 0),
    e = 1..7 the magnitudes 2^-6 s .. s, two nibbles per byte, even index low (as int4). |x| / s
    rounds to the nearest of 0, 2^-6, ..., 1 (linear distance, ties up), so |x - decoded| <=
    max(|x| / 3, 2^-7 s): within a binade [2^j, 2^(j+1)) the worst case is the midpoint 1.5 2^j.
    Exponent bits beat int4's uniform levels on the heavy-tailed entries of pseudo-gradients:
    relative error 1/3 down to 2^-6 max|x|, where int4 already rounds to 0. An all-zero tensor gets
    s = 0."""

    wire_id = pb.CODEC_FP4
    name = "fp4"
    param_count = 1

    def encode(self, tensor: torch.Tensor) -> Encoded:
        tensor, amax = self._check_input(tensor)
        flat = tensor.reshape(-1)
        safe = torch.where(amax > 0, amax, torch.ones_like(amax))
        ratio = flat.abs().div_(safe)  # in [0, 1]
        mantissa, exponent = torch.frexp(ratio)  # ratio = m 2^E, m in [0.5, 1)
        # nearest power of two: 2^E when m >= 0.75, else 2^(E-1); e = that exponent + 7
        code = (exponent + 6 + (mantissa >= 0.75).to(exponent.dtype)).clamp_(1, 7)
        code = torch.where(ratio >= 2.0 ** (FP4_MIN_EXPONENT - 1), code, torch.zeros_like(code))
        sign = ((flat < 0) & (code > 0)).to(torch.uint8) << 3
        q = code.to(torch.uint8) | sign
        return Encoded(self.wire_id, _pack_nibbles(q), (float(amax),), torch.float32, tuple(tensor.shape))

    def decode(self, payload, params, shape, dtype=torch.float32):
        (scale,) = self._check_params(params, self.param_count)
        _check_scale("fp4", scale)
        self._check_dtype(dtype)
        numel = _numel(shape)
        packed = _reinterpret(payload, torch.uint8, self.payload_bytes(numel), self.name)
        q = _unpack_nibbles(packed, numel).to(torch.long)
        magnitudes = torch.tensor([0.0] + [2.0 ** e for e in range(FP4_MIN_EXPONENT, 1)], device=packed.device)
        value = magnitudes[q & 7].mul_(scale)
        out = torch.where(q >= 8, -value, value).reshape(tuple(int(d) for d in shape))
        return out if dtype == torch.float32 else out.to(dtype)

    def payload_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return (int(numel) + 1) // 2


class Halves(Codec):
    """The first ⌊n/2⌋ elements by codec A, the others by codec B: a push-sum share of gossip-DiLoCo,
    x = w [θ^anchor ; Δ], keeps its anchors dense (A, e.g. int8: a sparse anchor half would bias
    the de-biased x / w) while its pseudo-gradients go sparse (B). A's payload size must follow from
    the element count alone (not a top-k codec); B's params say its own. Not a config name: the
    algorithm builds one (make_halves), and any Halves object decodes any Halves payload."""

    wire_id = pb.CODEC_HALVES
    name = "halves"

    def __init__(self, first: Codec, second: Codec):
        if isinstance(first, (Halves, TopK, _ChunkedTopK)) or isinstance(second, Halves):
            raise CompressionError(f"halves: codec A must have a fixed size and neither may be halves, got "
                                   f"{first.name} and {second.name}")
        self.first, self.second = first, second
        self.param_count = 2 + first.param_count + second.param_count

    def encode(self, tensor: torch.Tensor) -> Encoded:
        flat = tensor.detach().reshape(-1)
        split = flat.numel() // 2
        a, b = self.first.encode(flat[:split]), self.second.encode(flat[split:])
        payload = torch.cat([a.payload.reshape(-1).view(torch.uint8), b.payload.reshape(-1).view(torch.uint8)])
        return Encoded(self.wire_id, payload, (float(a.codec), *a.params, float(b.codec), *b.params), torch.float32,
                       tuple(tensor.shape))

    def decode(self, payload, params, shape, dtype=torch.float32):
        try:
            params = tuple(float(p) for p in params)
        except (TypeError, ValueError) as exc:
            raise CompressionError(f"halves: codec params must be numbers, got {params!r}") from exc
        first = self._part(params, 0)
        second = self._part(params, 1 + first.param_count)
        if isinstance(first, (Halves, TopK, _ChunkedTopK)) or isinstance(second, Halves) \
                or len(params) != 2 + first.param_count + second.param_count:
            raise CompressionError(f"halves: codec params {params} do not describe a fixed-size codec and another")
        numel = _numel(shape)
        split = numel // 2
        if not isinstance(payload, torch.Tensor):
            raise CompressionError(f"halves: payload must be a torch.Tensor, got {type(payload).__name__}")
        raw = _reinterpret(payload, torch.uint8, payload.numel() * payload.element_size(), self.name)
        size = first.payload_bytes(split)
        if raw.numel() < size:
            raise CompressionError(f"halves: payload has {raw.numel()} bytes, fewer than its first half's {size}")
        a = first.decode(raw[:size], params[1:1 + first.param_count], (split,), torch.float32)
        b = second.decode(raw[size:], params[2 + first.param_count:], (numel - split,), torch.float32)
        out = torch.cat([a, b]).reshape(tuple(int(d) for d in shape))
        return out if dtype == torch.float32 else out.to(dtype)

    def _part(self, params: tuple[float, ...], at: int) -> Codec:
        if at >= len(params) or not float(params[at]).is_integer():
            raise CompressionError(f"halves: codec params {params} lack a codec id at {at}")
        return get_codec(int(params[at]))

    def payload_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        split = int(numel) // 2
        return self.first.payload_bytes(split) + self.second.payload_bytes(int(numel) - split)

    def __repr__(self) -> str:
        return f"Halves({self.first!r}, {self.second!r})"


CODECS: dict[str, Codec] = {"none": NoCompression(), "trunc16": Trunc16(), "fp16": Fp16(), "bf16": Bf16Round(),
                            "int8": Int8Quantize(), "int4": Int4Quantize(), "topk": TopK(),
                            "sparseloco": SparseLoCo(), "dct-topk": DctTopK(), "fp4": Fp4()}
_BY_WIRE_ID: dict[int, Codec] = {c.wire_id: c for c in CODECS.values()}
_BY_WIRE_ID[Halves.wire_id] = Halves(Int8Quantize(), NoCompression())  # (a decoder of any halves payload)


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


def make_codec(name: str, *, topk_fraction: float | None = None, value_bits: int | None = None) -> Codec:
    """The codec `name`; for "topk", one keeping `topk_fraction` of the entries (default
    DEFAULT_TOPK_FRACTION); for "sparseloco" and "dct-topk", that fraction of each chunk, its
    values in `value_bits` bits (default DEFAULT_VALUE_BITS). Their payload sizes depend on those,
    so one codec object per setting, while decoding reads them off the payload and codec params."""
    key = name.strip().lower()
    if key == "topk" and topk_fraction is not None:
        return TopK(topk_fraction)
    if key in ("sparseloco", "dct-topk") and (topk_fraction is not None or value_bits is not None):
        kind = SparseLoCo if key == "sparseloco" else DctTopK
        return kind(DEFAULT_TOPK_FRACTION if topk_fraction is None else topk_fraction,
                    DEFAULT_VALUE_BITS if value_bits is None else value_bits)
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
