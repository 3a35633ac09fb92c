"""Lossy tensor codecs for the wire, after Pipe-SGD (seed 004).

Seed 004 compresses the exchanged tensors with "16-bit truncation (drop low mantissa bits)" and
"8-bit scalar quantization with range from the max |value|". A codec turns a float32 tensor into
a payload (the bytes that travel as TensorChunk data) plus a few doubles (`codec_params` of the
TensorHeader, e.g. the int8 scale); `header.codec` carries the codec's `wire_id` (pb.CODEC_*).

Everything is plain vectorized torch so it runs on whatever device the tensor lives on; the only
host syncs are the finiteness check and reading the int8 scale, which must go into the header.
Imports nothing from the project but the generated proto enum. Its names are listed, without
importing torch, in p2ptrain.compression.CODEC_NAMES (a test keeps the two in step).
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
    """Encode a tensor for the wire and decode it back; stateless, so one instance is shared."""

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


class Fp16Truncate(Codec):
    """Seed 004 "16-bit truncation": keep the upper 16 bits of each float32 bit pattern.

    That is sign, the full 8-bit exponent and 7 mantissa bits, i.e. bfloat16 rounded toward
    zero (not to nearest): no overflow for any finite float32, |decoded| <= |x|, and relative
    error < 2^-7 for normal values. Done with int32 bit ops so it runs on any device.
    """

    wire_id = pb.CODEC_FP16_TRUNCATE
    name = "fp16"
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
        scale = amax / 127.0
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


CODECS: dict[str, Codec] = {"none": NoCompression(), "fp16": Fp16Truncate(), "int8": Int8Quantize()}
_BY_WIRE_ID: dict[int, Codec] = {c.wire_id: c for c in CODECS.values()}


def get_codec(name_or_wire_id: str | int) -> Codec:
    """Look a codec up by config name ("none"/"fp16"/"int8") or by header wire id (pb.CODEC_*)."""
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
