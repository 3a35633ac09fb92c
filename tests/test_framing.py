"""The hand-encoded hot path of the chunk framing against the generated protobuf classes."""
from __future__ import annotations

import random

import pytest
import torch

from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.transport.framing import (
    MAX_CHUNK_BYTES,
    MIN_CHUNK_BYTES,
    DecodedChunk,
    FramingError,
    check_chunk_bytes,
    decode_chunk,
    deserialize_chunk,
    encode_data,
    encode_header,
    iter_data_chunks,
    tensor_bytes,
    torch_dtype,
    wire_dtype,
)

torch.set_num_threads(1)

# Sizes around the varint length boundaries (1 / 2 / 3 bytes) and one larger than 1 MiB.
SIZES = [0, 1, 127, 128, 16383, 16384, (1 << 20) + 3]


def _payload(n: int) -> bytes:
    return bytes((i * 7 + 3) % 256 for i in range(n)) if n < 70_000 else random.Random(n).randbytes(n)


def _varint_len(n: int) -> int:
    return max(1, (n.bit_length() + 6) // 7)


@pytest.mark.parametrize("size", SIZES)
def test_encode_data_is_valid_protobuf(size: int):
    payload = _payload(size)
    raw = encode_data(payload)
    assert len(raw) == 1 + _varint_len(size) + size
    assert raw == pb.TensorChunk(data=payload).SerializeToString()
    message = pb.TensorChunk.FromString(raw)
    assert message.WhichOneof("payload") == "data"
    assert message.data == payload


@pytest.mark.parametrize("size", SIZES)
def test_encode_data_accepts_memoryview(size: int):
    payload = _payload(size)
    assert encode_data(memoryview(payload)) == encode_data(payload)


@pytest.mark.parametrize("size", SIZES)
def test_decode_chunk_of_generated_encoding(size: int):
    payload = _payload(size)
    decoded = decode_chunk(pb.TensorChunk(data=payload).SerializeToString())
    assert decoded.header is None
    assert bytes(decoded.data) == payload
    # and our own encoding decodes to the same bytes (the zero-copy path)
    decoded_own = decode_chunk(encode_data(payload))
    assert decoded_own.header is None
    assert bytes(decoded_own.data) == payload


def test_decode_chunk_data_is_zero_copy_view():
    raw = encode_data(b"abcdef")
    decoded = decode_chunk(raw)
    assert isinstance(decoded.data, memoryview)
    assert decoded.data.obj is raw


def test_header_round_trip():
    header = pb.TensorHeader(sender=3, receiver=1, step=12345678901, kind=pb.MESSAGE_KIND_PUSH_SUM,
                             dtype=pb.DTYPE_BFLOAT16, shape=[2, 3, 4], numel=24, payload_bytes=48,
                             codec=pb.CODEC_INT8_QUANTIZE, codec_params=[0.5, -2.0], ps_weight=0.25,
                             relay_count=3.0, message_id=(1 << 63) + 5, route=[4, 5], channel="ring:3")
    raw = encode_header(header)
    assert pb.TensorChunk.FromString(raw).header == header
    decoded = decode_chunk(raw)
    assert decoded.data is None
    assert decoded.header == header
    assert decoded.header.message_id == (1 << 63) + 5
    assert list(decoded.header.codec_params) == [0.5, -2.0]


def test_empty_header_is_still_a_header():
    decoded = decode_chunk(encode_header(pb.TensorHeader()))
    assert decoded.data is None and decoded.header == pb.TensorHeader()


def _reassemble(chunks: list[bytes]) -> bytes:
    out = b""
    for raw in chunks:
        message = pb.TensorChunk.FromString(raw)
        assert message.WhichOneof("payload") == "data"
        out += message.data
    return out


@pytest.mark.parametrize("size, chunk, expected_lengths", [
    (100, 4096, [100]),                     # smaller than one chunk
    (10_000, 4096, [4096, 4096, 1808]),     # not a multiple
    (0, 4096, []),                          # empty: no chunk at all
    (12_288, 4096, [4096, 4096, 4096]),     # exact multiple: no trailing empty chunk
    (4096, 4096, [4096]),
    (4097, 4096, [4096, 1]),
])
def test_iter_data_chunks_covers_payload_exactly(size: int, chunk: int, expected_lengths: list[int]):
    payload = _payload(size)
    chunks = list(iter_data_chunks(memoryview(payload), chunk))
    assert [len(pb.TensorChunk.FromString(c).data) for c in chunks] == expected_lengths
    assert _reassemble(chunks) == payload


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8,
                                   torch.float64, torch.uint8])
def test_tensor_bytes_round_trip(dtype: torch.dtype):
    gen = torch.Generator().manual_seed(1)
    if dtype.is_floating_point:
        tensor = (torch.randn(37, 5, generator=gen) * 100).to(dtype)
    else:
        tensor = torch.randint(-128 if dtype == torch.int8 else 0, 128 if dtype == torch.int8 else 256,
                               (37, 5), generator=gen, dtype=dtype)
    view = tensor_bytes(tensor)
    assert isinstance(view, memoryview)
    assert len(view) == tensor.numel() * tensor.element_size()
    back = torch.frombuffer(bytearray(view), dtype=dtype).reshape(37, 5)
    assert torch.equal(back, tensor)
    # and through the wire dtype mapping
    assert torch_dtype(wire_dtype(dtype)) == dtype


def test_tensor_bytes_is_zero_copy_for_contiguous_tensors():
    tensor = torch.zeros(8, dtype=torch.float32)
    view = tensor_bytes(tensor)
    tensor[0] = 1.0
    assert bytes(view[:4]) == torch.tensor([1.0]).numpy().tobytes()


def test_tensor_bytes_non_contiguous_and_scalar_and_empty():
    base = torch.arange(20, dtype=torch.float32).reshape(4, 5)
    transposed = base.t()
    assert not transposed.is_contiguous()
    back = torch.frombuffer(bytearray(tensor_bytes(transposed)), dtype=torch.float32)
    assert torch.equal(back, transposed.contiguous().reshape(-1))
    assert bytes(tensor_bytes(torch.tensor(2.5))) == torch.tensor([2.5]).numpy().tobytes()
    assert len(tensor_bytes(torch.empty(0, dtype=torch.bfloat16))) == 0


def test_wire_dtype_rejects_unsupported():
    with pytest.raises(ValueError, match="cannot be sent"):
        wire_dtype(torch.int64)
    with pytest.raises(FramingError, match="unknown wire dtype 99"):
        torch_dtype(99)


def test_check_chunk_bytes_bounds():
    assert check_chunk_bytes(MIN_CHUNK_BYTES) == MIN_CHUNK_BYTES
    assert check_chunk_bytes(MAX_CHUNK_BYTES) == MAX_CHUNK_BYTES
    for bad in (MIN_CHUNK_BYTES - 1, MAX_CHUNK_BYTES + 1, 0, -5):
        with pytest.raises(ValueError, match="outside"):
            check_chunk_bytes(bad)


MALFORMED = {
    "empty": b"",
    "truncated_varint": b"\x12",
    "truncated_varint_continuation": b"\x12\x80",
    "oversized_varint": b"\x12" + b"\xff" * 11,
    "length_longer_than_present": b"\x12\x05abc",
    "large_length_short_body": b"\x12" + bytes([0x80, 0x80, 0x04]) + b"x" * 100,
    "header_length_longer_than_present": b"\x0a\x05ab",
    "garbage_ff": b"\xff" * 16,
    "garbage_text": b"hello world",
    "zero_tag": b"\x00\x00",
    "unknown_field_only": b"\x08\x01",  # valid protobuf, but neither header nor data
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_chunks_raise_framing_error(name: str):
    raw = MALFORMED[name]
    with pytest.raises(FramingError):
        decode_chunk(raw)
    result = deserialize_chunk(raw)  # the server deserializer never raises
    assert isinstance(result, FramingError)
    assert isinstance(result, ValueError)


def test_random_garbage_never_escapes_as_another_exception():
    rng = random.Random(1234)
    framing_errors = 0
    for _ in range(1000):
        raw = rng.randbytes(rng.randrange(1, 64))
        result = deserialize_chunk(raw)
        assert isinstance(result, (FramingError, DecodedChunk))
        if isinstance(result, FramingError):
            framing_errors += 1
        else:  # if protobuf happens to accept it, it is exactly one of header / data
            assert (result.header is None) != (result.data is None)
    assert framing_errors > 900  # random bytes are almost never a TensorChunk


def test_deserialize_chunk_passes_valid_chunks_through():
    result = deserialize_chunk(encode_data(b"xyz"))
    assert isinstance(result, DecodedChunk) and bytes(result.data) == b"xyz"
    header = pb.TensorHeader(sender=1, numel=3)
    result = deserialize_chunk(encode_header(header))
    assert isinstance(result, DecodedChunk) and result.header == header
