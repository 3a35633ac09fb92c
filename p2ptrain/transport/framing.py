"""Chunk framing of the PushTensor stream.

The stream is `TensorChunk{header}` followed by `TensorChunk{data}` messages (proto/…/p2ptrain.proto).
Data chunks are the hot path, so they are encoded and decoded by hand in exactly the protobuf
wire format (field 2, length-delimited: 0x12, varint length, bytes): encoding is one copy from the
tensor's memory, decoding is a zero-copy memoryview into gRPC's receive buffer. Headers and any
other message go through the generated protobuf classes. tests/test_framing.py checks both
directions against the generated TensorChunk.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from p2ptrain._proto import p2ptrain_pb2 as pb

DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024
MIN_CHUNK_BYTES = 4 * 1024
MAX_CHUNK_BYTES = 64 * 1024 * 1024
_HEADER_TAG = 0x0A  # field 1, wire type 2
_DATA_TAG = 0x12  # field 2, wire type 2

TORCH_TO_WIRE = {
    torch.float32: pb.DTYPE_FLOAT32,
    torch.float16: pb.DTYPE_FLOAT16,
    torch.bfloat16: pb.DTYPE_BFLOAT16,
    torch.float64: pb.DTYPE_FLOAT64,
    torch.int8: pb.DTYPE_INT8,
    torch.uint8: pb.DTYPE_UINT8,
}
WIRE_TO_TORCH = {v: k for k, v in TORCH_TO_WIRE.items()}


class FramingError(ValueError):
    """A chunk that is not a well-formed TensorChunk."""


def wire_dtype(dtype: torch.dtype) -> int:
    try:
        return TORCH_TO_WIRE[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot be sent; supported: "
                         f"{', '.join(str(d) for d in TORCH_TO_WIRE)}") from None


def torch_dtype(wire: int) -> torch.dtype:
    try:
        return WIRE_TO_TORCH[wire]
    except KeyError:
        raise FramingError(f"unknown wire dtype {wire}") from None


def check_chunk_bytes(chunk_bytes: int) -> int:
    if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk size {chunk_bytes} bytes outside [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}]")
    return chunk_bytes


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """Zero-copy byte view of a contiguous CPU tensor (any dtype, bfloat16 included)."""
    if tensor.device.type != "cpu":
        raise ValueError("only CPU tensors can be framed; stage device tensors to host first")
    flat = tensor.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        bits = value & 0x7F
        value >>= 7
        if value:
            out.append(bits | 0x80)
        else:
            out.append(bits)
            return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise FramingError("truncated or oversized varint in chunk")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def encode_header(header: pb.TensorHeader) -> bytes:
    return pb.TensorChunk(header=header).SerializeToString()


def encode_data(payload: memoryview | bytes) -> bytes:
    """Wire bytes of TensorChunk{data=payload}: a single copy of the payload."""
    return bytes((_DATA_TAG,)) + _varint(len(payload)) + payload


def iter_data_chunks(payload: memoryview, chunk_bytes: int) -> Iterator[bytes]:
    """Encoded data chunks covering `payload`; an empty payload yields no chunk."""
    for offset in range(0, len(payload), chunk_bytes):
        yield encode_data(payload[offset:offset + chunk_bytes])


@dataclass(frozen=True)
class DecodedChunk:
    """A received chunk: exactly one of `header` / `data` is set."""

    header: pb.TensorHeader | None = None
    data: memoryview | None = None


def decode_chunk(raw: bytes) -> DecodedChunk:
    """Inverse of encode_header / encode_data; falls back to full protobuf parsing for any other
    valid encoding of TensorChunk (e.g. from another implementation). Raises FramingError."""
    view = memoryview(raw)
    if len(view) and view[0] == _DATA_TAG:
        length, pos = _read_varint(view, 1)
        if pos + length == len(view):
            return DecodedChunk(data=view[pos:])
    try:
        message = pb.TensorChunk.FromString(raw)
    except Exception as exc:  # protobuf's DecodeError and friends
        raise FramingError(f"chunk is not a TensorChunk: {exc}") from None
    which = message.WhichOneof("payload")
    if which == "header":
        return DecodedChunk(header=message.header)
    if which == "data":
        return DecodedChunk(data=memoryview(message.data))
    raise FramingError("empty chunk: neither header nor data set")


def serialize_identity(raw: bytes) -> bytes:
    """Request serializer for pre-encoded chunks."""
    return raw


def deserialize_chunk(raw: bytes) -> DecodedChunk | FramingError:
    """Server-side request deserializer: never raises, so the handler can answer a malformed
    chunk with a rejecting Ack instead of gRPC aborting the call with INTERNAL."""
    try:
        return decode_chunk(raw)
    except FramingError as exc:
        return exc
