"""Wire codecs of seed 004 (Pipe-SGD): 16-bit truncation (trunc16) and int8 max-|x| quantization; those
of DiLoCo's pseudo-gradients: bf16 rounding, int4 max-|x| quantization, top-k with error feedback; and
IEEE half precision with a power-of-two scale (fp16)."""
import math

import numpy as np
import pytest
import torch

from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.compression import (
    CODEC_NAMES,
    CODECS,
    CompressionError,
    Encoded,
    Fp16,
    Int8Quantize,
    NoCompression,
    TopK,
    Trunc16,
    encode_with_feedback,
    get_codec,
    make_codec,
)

torch.set_num_threads(1)

TRUNC16 = get_codec("trunc16")
FP16 = get_codec("fp16")
INT8 = get_codec("int8")
NONE = get_codec("none")
BF16 = get_codec("bf16")
INT4 = get_codec("int4")
TOPK = get_codec("topk")


def _wide_range(n_per_mag: int = 200, seed: int = 0) -> torch.Tensor:
    """Random normal values scaled to magnitudes 1e-30 .. 1e30, both signs."""
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randn(n_per_mag, generator=g) * (10.0 ** e) for e in range(-30, 31, 5)]
    x = torch.cat(parts)
    return x[x != 0]


def _roundtrip(codec, x: torch.Tensor) -> tuple[Encoded, torch.Tensor]:
    enc = codec.encode(x)
    return enc, codec.decode(enc.payload, enc.params, enc.shape, enc.dtype)


# -- 16-bit truncation -----------------------------------------------------------------------------
def test_trunc16_relative_error_bound_over_magnitudes():
    x = _wide_range()
    assert x.abs().min() > 1e-37 and torch.isfinite(x).all()  # finite normals only
    _, y = _roundtrip(TRUNC16, x)
    rel = ((y - x).abs() / x.abs()).max().item()
    assert rel <= 2.0 ** -7


def test_trunc16_truncates_toward_zero_and_matches_numpy_bits():
    x = torch.cat([_wide_range(seed=1), torch.tensor([0.0, -0.0, 1.0, -1.0, 3.0e38, -3.0e38, 1e-40])])
    _, y = _roundtrip(TRUNC16, x)
    assert (y.abs() <= x.abs()).all()
    assert (torch.sign(y) * torch.sign(x) >= 0).all()
    ref = (x.numpy().view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    assert np.array_equal(y.numpy().view(np.uint32), ref.view(np.uint32))


def test_trunc16_payload_is_int16_upper_halves():
    x = torch.tensor([1.0, -2.5, 1.0 + 2.0 ** -10])
    enc = TRUNC16.encode(x)
    assert enc.payload.dtype == torch.int16 and enc.payload.is_contiguous()
    expected = (x.numpy().view(np.uint32) >> 16).astype(np.uint16).view(np.int16)
    assert np.array_equal(enc.payload.numpy(), expected)
    assert enc.codec == pb.CODEC_TRUNC16 == 1 and enc.params == ()  # wire id 1 kept its encoding


# -- fp16: IEEE half precision of x / 2^e ----------------------------------------------------------
def _fp16_reference(x: torch.Tensor) -> tuple[float, np.ndarray]:
    """(scale, decoded) in numpy float64: scale = 2^(floor(log2 max|x|) - 14), so max|x| / scale is
    in [2^14, 2^15); decoded = numpy's half rounding of x / scale, times scale."""
    values = x.double().numpy().reshape(-1)
    amax = float(np.abs(values).max())
    scale = 2.0 ** (int(np.floor(np.log2(amax))) - 14)
    return scale, (values / scale).astype(np.float16).astype(np.float64) * scale


@pytest.mark.parametrize("mag", [1e-30, 1e-6, 1e-3, 1.0, 1e4, 1e30])
def test_fp16_is_numpys_half_of_the_scaled_tensor_bit_for_bit(mag):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(5000, generator=g) * mag
    enc, y = _roundtrip(FP16, x)
    scale, ref = _fp16_reference(x)
    assert enc.codec == pb.CODEC_FP16 == 6 and enc.payload.dtype == torch.int16 and enc.params == (scale,)
    assert 2.0 ** 14 <= x.abs().max().item() / scale < 2.0 ** 15
    assert np.array_equal(y.double().numpy(), ref)


def test_fp16_error_bounds_and_three_more_bits_than_trunc16():
    """<= 2^-11 relative for every |x| >= max|x| 2^-28; at most 2^-39 max|x| below (half's subnormals)."""
    for x in (_wide_range(seed=2), torch.randn(20000, generator=torch.Generator().manual_seed(4)) * 1e-4):
        _, y = _roundtrip(FP16, x)
        amax, err = x.abs().max().item(), (y - x).abs()
        upper = x.abs() >= amax * 2.0 ** -28
        assert (err[upper] / x.abs()[upper]).max().item() <= 2.0 ** -11
        assert (err <= torch.maximum(x.abs() * 2.0 ** -11, torch.tensor(amax * 2.0 ** -39))).all()
    x = torch.randn(20000, generator=torch.Generator().manual_seed(4))
    _, half = _roundtrip(FP16, x)
    _, trunc = _roundtrip(TRUNC16, x)
    assert ((half - x).abs() / x.abs()).max().item() <= 2.0 ** -11
    assert ((trunc - x).abs() / x.abs()).max().item() > 2.0 ** -8  # truncation keeps 8 significant bits


def test_fp16_scale_keeps_large_and_small_tensors_in_half_range():
    """Plain half precision overflows above 65504 and goes subnormal below 2^-14; the scale avoids both,
    and magnitudes within 2^-11 of the largest float32 are clamped instead of rounding up to 2^128."""
    flt_max = torch.finfo(torch.float32).max
    for big in (torch.tensor([1e5, -7e4, 65520.0, 3.0]), torch.tensor([3.0e38, flt_max, -flt_max, 1e36])):
        assert torch.isinf(big[:3].half()).all()
        _, y = _roundtrip(FP16, big)
        assert torch.isfinite(y).all() and ((y - big).abs() / big.abs()).max().item() <= 2.0 ** -11
    assert y[1].item() == -y[2].item() == float.fromhex("0x1.ffcp+127")  # (1 - 2^-11) 2^128
    small = torch.randn(1000, generator=torch.Generator().manual_seed(6)) * 1e-6
    plain = small.half().float()
    assert ((plain - small).abs() / small.abs()).max().item() > 1e-2  # subnormal halves
    _, y = _roundtrip(FP16, small)
    assert ((y - small).abs() / small.abs()).max().item() <= 2.0 ** -11
    tiny = torch.tensor([1e-45, -1e-40, 3e-39])  # float32 subnormals: the scale stops at 2^-126
    enc, y = _roundtrip(FP16, tiny)
    assert enc.params == (2.0 ** -126,)
    assert ((y - tiny).abs() / tiny.abs()).max().item() <= 2.0 ** -11


def test_fp16_all_zeros_and_empty():
    for x in (torch.zeros(3, 2), torch.zeros(0), torch.tensor(-0.0)):
        enc, y = _roundtrip(FP16, x)
        assert enc.params == (1.0,) and torch.equal(y, x) and y.shape == x.shape


@pytest.mark.parametrize("params", [(), (1.0, 2.0), (-0.5,), (0.0,), (3.0,), (float("nan"),), (float("inf"),),
                                    (2.0 ** -127,), (2.0 ** 114,)])
def test_fp16_decode_refuses_scales_the_encoder_never_sends(params):
    enc = FP16.encode(torch.randn(10))
    with pytest.raises(CompressionError, match="param|power of two"):
        FP16.decode(enc.payload, params, enc.shape)
    for end in (2.0 ** -126, 2.0 ** 113):  # the range's ends decode
        unscaled = FP16.decode(enc.payload, (1.0,), enc.shape)
        assert torch.equal(FP16.decode(enc.payload, (end,), enc.shape), unscaled * end)


def test_fp16_and_trunc16_have_their_own_wire_ids_so_mixed_versions_refuse():
    """"fp16" used to name truncation (wire id 1, now trunc16). Real half precision got a new id, so a
    receiver still declaring id 1 for "fp16" refuses the new encoding, and one declaring fp16 refuses
    truncated payloads: a version mix is refused, never misdecoded."""
    from p2ptrain.transport.validation import ChannelSpec, CodecLayout, Rejection, validate_header

    n = 100
    old_fp16 = ChannelSpec(torch.float32, n, {pb.CODEC_TRUNC16: CodecLayout(2 * n, 0)})
    new_fp16 = ChannelSpec(torch.float32, n, {FP16.wire_id: CodecLayout(FP16.payload_bytes(n), FP16.param_count)})
    for codec, spec in ((FP16, old_fp16), (TRUNC16, new_fp16)):
        enc = codec.encode(torch.randn(n))
        header = pb.TensorHeader(dtype=pb.DTYPE_FLOAT32, numel=n, codec=enc.codec, codec_params=enc.params,
                                 payload_bytes=enc.nbytes)
        with pytest.raises(Rejection, match="is not accepted here") as exc:
            validate_header(header, spec, world_size=4)
        assert exc.value.reason == "bad_codec"
        validate_header(header, ChannelSpec(torch.float32, n, {enc.codec: CodecLayout(enc.nbytes, codec.param_count)}),
                        world_size=4)  # accepted where declared


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["trunc16", "fp16", "bf16", "int8", "int4"])
def test_codecs_send_the_same_bytes_from_cuda_as_from_cpu(name):
    """A GPU node and a CPU node encode a tensor to the same bytes and scale (a mixed cluster's
    rings stay bit-identical). Many magnitudes: a scale divided as a reciprocal product on the GPU
    was one ulp off for some of them (int4, 1e-3)."""
    codec = CODECS[name]
    for seed in range(20):
        x = torch.randn(100003, generator=torch.Generator().manual_seed(seed)) * 10.0 ** (seed % 10 - 5)
        on_cpu, on_gpu = codec.encode(x), codec.encode(x.cuda())
        assert on_gpu.payload.is_cuda and on_gpu.params == on_cpu.params, seed
        assert torch.equal(on_gpu.payload.cpu(), on_cpu.payload), seed
        back = codec.decode(on_gpu.payload, on_gpu.params, on_gpu.shape)
        assert back.is_cuda and torch.equal(back.cpu(), codec.decode(on_cpu.payload, on_cpu.params, on_cpu.shape))


# -- int8 quantization -----------------------------------------------------------------------------
@pytest.mark.parametrize("mag", [1e-20, 1e-3, 1.0, 1e4, 1e20])
def test_int8_error_bound(mag):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1000, generator=g) * mag
    enc, y = _roundtrip(INT8, x)
    bound = x.abs().max().item() / 127
    assert (y - x).abs().max().item() <= bound
    assert enc.payload.dtype == torch.int8
    assert enc.payload.abs().max().item() <= 127
    (scale,) = enc.params
    assert scale == pytest.approx(x.abs().max().item() / 127, rel=1e-6)


def test_int8_extremes_are_exact_and_all_zeros_decode_to_zeros():
    x = torch.tensor([-4.0, 0.0, 2.0, 4.0])
    enc, y = _roundtrip(INT8, x)
    assert enc.payload.tolist() == [-127, 0, 64, 127]  # 2 / (4/127) = 63.5 -> round half even = 64
    assert y[0].item() == -4.0 and y[3].item() == 4.0 and y[1].item() == 0.0
    zeros = torch.zeros(2, 3)
    enc, y = _roundtrip(INT8, zeros)
    assert enc.params == (0.0,)
    assert torch.equal(y, zeros) and torch.isfinite(y).all()


# -- shapes, dtypes, sizes -------------------------------------------------------------------------
@pytest.mark.parametrize("name,per_elem", [("none", 4), ("trunc16", 2), ("fp16", 2), ("int8", 1)])
@pytest.mark.parametrize("shape", [(10,), (3, 4, 5), (0,), (2, 0, 3), ()])
def test_shapes_dtypes_and_payload_bytes(name, per_elem, shape):
    codec = CODECS[name]
    x = torch.randn(shape)
    enc, y = _roundtrip(codec, x)
    assert y.shape == x.shape and y.dtype == torch.float32
    assert enc.shape == tuple(shape) and enc.dtype == torch.float32
    real = enc.payload.numel() * enc.payload.element_size()
    assert real == enc.nbytes == codec.payload_bytes(x.numel()) == per_elem * x.numel()
    if name == "none":
        assert torch.equal(y, x)


def test_compression_ratio():
    x = torch.randn(4096)
    raw = x.numel() * x.element_size()
    assert TRUNC16.encode(x).nbytes * 2 == raw
    assert FP16.encode(x).nbytes * 2 == raw
    assert INT8.encode(x).nbytes * 4 == raw
    assert NONE.encode(x).nbytes == raw


def test_non_contiguous_input_and_uint8_wire_buffer():
    base = torch.randn(6, 8)
    x = base.t()  # non-contiguous
    assert not x.is_contiguous()
    for codec in (TRUNC16, FP16, INT8, NONE):
        enc = codec.encode(x)
        assert enc.payload.is_contiguous()
        direct = codec.decode(enc.payload, enc.params, enc.shape)
        # the receiver sees raw bytes: decode must accept a uint8 buffer as well
        wire = torch.frombuffer(bytearray(enc.payload.numpy().tobytes()), dtype=torch.uint8)
        via_bytes = codec.decode(wire, list(enc.params), list(enc.shape))
        assert torch.equal(direct, via_bytes) and direct.shape == (8, 6)


def test_none_passes_non_finite_values_untouched():
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.5])
    _, y = _roundtrip(NONE, x)
    assert torch.equal(y.view(torch.int32), x.view(torch.int32))


# -- errors ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("codec", [TRUNC16, FP16, INT8], ids=["trunc16", "fp16", "int8"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_rejected(codec, bad):
    x = torch.randn(1000)
    x[[3, 50, 999]] = bad
    with pytest.raises(CompressionError, match="NaN/Inf") as exc:
        codec.encode(x)
    assert "3 non-finite of 1000" in str(exc.value)


@pytest.mark.parametrize("codec", [TRUNC16, FP16, INT8], ids=["trunc16", "fp16", "int8"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16, torch.int32])
def test_non_float32_input_rejected(codec, dtype):
    with pytest.raises(CompressionError, match=str(dtype)):
        codec.encode(torch.ones(4, dtype=dtype))


def test_decode_wrong_payload_size():
    for codec in (TRUNC16, FP16, INT8, NONE):
        enc = codec.encode(torch.randn(10))
        with pytest.raises(CompressionError, match="bytes"):
            codec.decode(enc.payload, enc.params, (11,))
        with pytest.raises(CompressionError, match="bytes"):
            codec.decode(enc.payload[:-1], enc.params, (10,))


@pytest.mark.parametrize("params", [(), (1.0, 2.0), (-0.5,), (float("nan"),), (float("inf"),)])
def test_int8_decode_bad_scale(params):
    enc = INT8.encode(torch.randn(10))
    with pytest.raises(CompressionError):
        INT8.decode(enc.payload, params, enc.shape)


def test_trunc16_decode_rejects_params():
    enc = TRUNC16.encode(torch.randn(4))
    with pytest.raises(CompressionError, match="param"):
        TRUNC16.decode(enc.payload, (1.0,), enc.shape)


def test_get_codec_by_name_and_wire_id():
    assert isinstance(get_codec("none"), NoCompression)
    assert isinstance(get_codec("trunc16"), Trunc16)
    assert isinstance(get_codec("fp16"), Fp16)
    assert isinstance(get_codec("INT8"), Int8Quantize)
    assert get_codec(pb.CODEC_NONE) is CODECS["none"]
    assert get_codec(pb.CODEC_TRUNC16) is CODECS["trunc16"]
    assert get_codec(pb.CODEC_FP16) is CODECS["fp16"]
    assert get_codec(pb.CODEC_INT8_QUANTIZE) is CODECS["int8"]
    for codec in CODECS.values():
        assert get_codec(codec.wire_id) is codec and get_codec(codec.name) is codec
    with pytest.raises(CompressionError, match="unknown codec"):
        get_codec("zstd")
    with pytest.raises(CompressionError, match="unknown codec"):
        get_codec(99)
    with pytest.raises(CompressionError):
        get_codec(1.0)  # type: ignore[arg-type]


def test_large_scale_no_overflow():
    x = torch.tensor([3.0e38, -3.0e38, 1.0])
    _, y = _roundtrip(INT8, x)
    assert torch.isfinite(y).all()
    assert (y - x).abs().max().item() <= 3.0e38 / 127
    assert math.isfinite(INT8.encode(x).params[0])


def test_default_channel_layouts_match_the_codecs():
    """A channel declared without codecs accepts the fixed-rate codecs of seed 004 by their numbers
    alone (inbox.FIXED_RATE_CODECS: the transport never imports this module): pin those numbers
    here. fp16 and the DiLoCo codecs (bf16, int4, fp4, the top-k ones) are accepted only where a channel declares them
    (codecs=, with their exact layout), so a default channel refuses them."""
    from p2ptrain.transport.inbox import FIXED_RATE_CODECS

    wire_ids = {codec.wire_id for codec in CODECS.values()}
    assert set(FIXED_RATE_CODECS) | {pb.CODEC_NONE} <= wire_ids
    assert wire_ids - set(FIXED_RATE_CODECS) - {pb.CODEC_NONE} == {pb.CODEC_FP16, pb.CODEC_BF16, pb.CODEC_INT4_QUANTIZE,
                                                                    pb.CODEC_TOPK, pb.CODEC_SPARSELOCO,
                                                                    pb.CODEC_DCT_TOPK, pb.CODEC_FP4}
    x = torch.randn(1000)
    for wire_id, (per_element, params) in FIXED_RATE_CODECS.items():
        codec, encoded = get_codec(wire_id), get_codec(wire_id).encode(x)
        assert codec.payload_bytes(x.numel()) == encoded.nbytes == per_element * x.numel()
        assert codec.param_count == len(encoded.params) == params


def test_codec_names_and_codecs_stay_in_step():
    """p2ptrain.compression lists the names without importing torch; codecs.CODECS holds the codecs."""
    assert CODEC_NAMES == tuple(CODECS)
    assert all(CODECS[name].name == name for name in CODEC_NAMES)
    assert len({codec.wire_id for codec in CODECS.values()}) == len(CODECS)
    # (+ the halves of gossip-DiLoCo's shares, which the algorithm builds from two of them, and
    # push-sum's header-only void notices, which carry no tensor)
    assert set(pb.Codec.values()) == {codec.wire_id for codec in CODECS.values()} | {pb.CODEC_HALVES, pb.CODEC_VOID}


# -- bf16 rounding ---------------------------------------------------------------------------------
def test_bf16_rounds_to_nearest_within_half_an_ulp():
    x = _wide_range(seed=3)
    enc, y = _roundtrip(BF16, x)
    assert enc.codec == pb.CODEC_BF16 and enc.payload.dtype == torch.int16 and enc.params == ()
    assert ((y - x).abs() / x.abs()).max().item() <= 2.0 ** -8
    assert torch.equal(y, x.to(torch.bfloat16).float())  # torch's round-to-nearest-even, bit for bit
    _, t = _roundtrip(TRUNC16, x)  # nearest is never further than truncation
    assert ((y - x).abs() <= (t - x).abs()).all()


def test_bf16_clamps_beyond_the_largest_bfloat16_instead_of_overflowing():
    x = torch.tensor([3.4028235e38, -3.4e38, 1.0])
    _, y = _roundtrip(BF16, x)
    assert torch.isfinite(y).all() and y[0].item() == -y[1].item() == torch.finfo(torch.bfloat16).max


# -- int4 quantization -----------------------------------------------------------------------------
@pytest.mark.parametrize("mag", [1e-20, 1e-3, 1.0, 1e4, 1e20])
@pytest.mark.parametrize("numel", [1, 2, 999, 1000])
def test_int4_error_bound_and_packing(mag, numel):
    g = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=g) * mag
    enc, y = _roundtrip(INT4, x)
    scale = x.abs().max().item() / 7
    assert (y - x).abs().max().item() <= scale / 2 * (1 + 1e-6)
    assert enc.payload.dtype == torch.uint8 and enc.nbytes == (numel + 1) // 2 == INT4.payload_bytes(numel)
    (sent_scale,) = enc.params
    assert sent_scale == pytest.approx(scale, rel=1e-6)
    nibbles = torch.stack([enc.payload & 15, enc.payload >> 4], dim=1).reshape(-1)
    assert ((nibbles[:numel] >= 1) & (nibbles[:numel] <= 15)).all()
    assert numel % 2 == 0 or nibbles[-1].item() == 0  # the padding nibble


def test_int4_extremes_exact_and_all_zeros():
    x = torch.tensor([-7.0, 0.0, 2.0, 7.0, 3.5])
    enc, y = _roundtrip(INT4, x)
    assert y[0].item() == -7.0 and y[1].item() == 0.0 and y[3].item() == 7.0 and y[2].item() == 2.0
    assert enc.payload.tolist() == [1 | (8 << 4), 10 | (15 << 4), 12]  # 3.5 -> round half even = 4
    zeros = torch.zeros(5)
    enc, y = _roundtrip(INT4, zeros)
    assert enc.params == (0.0,) and torch.equal(y, zeros)


@pytest.mark.parametrize("params", [(), (1.0, 2.0), (-0.5,), (float("nan"),), (float("inf"),)])
def test_int4_decode_bad_scale(params):
    enc = INT4.encode(torch.randn(10))
    with pytest.raises(CompressionError):
        INT4.decode(enc.payload, params, enc.shape)


# -- top-k -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("fraction,numel,k", [(0.01, 1000, 10), (0.01, 50, 1), (0.1, 118282, 11828), (1.0, 7, 7),
                                              (0.25, 10, 2)])
def test_topk_keeps_the_k_largest_exactly_and_zeroes_the_rest(fraction, numel, k):
    codec = make_codec("topk", topk_fraction=fraction)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    enc, y = _roundtrip(codec, x)
    assert codec.kept(numel) == k and enc.nbytes == 8 * k == codec.payload_bytes(numel)
    kept = y != 0
    assert int(kept.sum()) == k
    assert torch.equal(y[kept], x[kept])  # the kept entries travel exactly
    assert x[kept].abs().min() >= x[~kept].abs().max() if k < numel else True
    index = enc.payload[:4 * k].view(torch.int32)
    assert (index[1:] > index[:-1]).all()  # ascending


def test_topk_decodes_with_any_fraction_and_from_raw_bytes():
    codec = make_codec("topk", topk_fraction=0.3)
    x = torch.randn(40)
    enc = codec.encode(x)
    wire = torch.frombuffer(bytearray(enc.payload.numpy().tobytes()), dtype=torch.uint8)
    assert torch.equal(get_codec(pb.CODEC_TOPK).decode(wire, (), (40,)), codec.decode(enc.payload, (), (40,)))


def _topk_payload(index, values):
    return torch.cat([torch.tensor(index, dtype=torch.int32).view(torch.uint8),
                      torch.tensor(values, dtype=torch.float32).view(torch.uint8)])


@pytest.mark.parametrize("index,values,match", [
    ([3, 1], [1.0, 2.0], "ascending"), ([1, 1], [1.0, 2.0], "ascending"), ([0, 10], [1.0, 2.0], "ascending"),
    ([-1, 2], [1.0, 2.0], "ascending"), ([0, 1], [float("nan"), 1.0], "non-finite"),
    ([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1.0] * 11, "k index/value")])
def test_topk_decode_refuses_forged_payloads(index, values, match):
    with pytest.raises(CompressionError, match=match):
        TOPK.decode(_topk_payload(index, values), (), (10,))
    with pytest.raises(CompressionError, match="k index/value"):
        TOPK.decode(torch.zeros(7, dtype=torch.uint8), (), (10,))


def test_topk_fraction_must_be_a_fraction():
    for bad in (0.0, -0.1, 1.5, float("nan")):
        with pytest.raises(CompressionError, match="fraction"):
            TopK(bad)


# -- the new codecs alike --------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["bf16", "int4", "topk"])
@pytest.mark.parametrize("shape", [(10,), (3, 4, 5), (0,), ()])
def test_new_codecs_shapes_and_payload_bytes(name, shape):
    codec = CODECS[name]
    x = torch.randn(shape)
    enc, y = _roundtrip(codec, x)
    assert y.shape == x.shape and y.dtype == torch.float32
    assert enc.nbytes == codec.payload_bytes(x.numel()) and len(enc.params) == codec.param_count


@pytest.mark.parametrize("name", ["bf16", "int4", "topk"])
def test_new_codecs_refuse_non_finite_input_and_wrong_sizes(name):
    codec = CODECS[name]
    x = torch.randn(100)
    x[7] = float("nan")
    with pytest.raises(CompressionError, match="NaN/Inf"):
        codec.encode(x)
    enc = codec.encode(torch.randn(100))
    with pytest.raises(CompressionError):
        codec.decode(enc.payload[:-1], enc.params, (100,))


# -- error feedback --------------------------------------------------------------------------------
def test_error_feedback_residual_plus_transmitted_is_the_input_exactly_for_topk():
    codec = make_codec("topk", topk_fraction=0.05)
    x = torch.randn(1000)
    residual = torch.full_like(x, 123.0)  # overwritten, not added to
    encoded, decoded = encode_with_feedback(codec, x, residual)
    assert torch.equal(decoded + residual, x)
    assert torch.equal(decoded, codec.decode(encoded.payload, encoded.params, (1000,)))
    assert int((residual == 0).sum()) == codec.kept(1000)


@pytest.mark.parametrize("name", ["none", "trunc16", "fp16", "bf16", "int8", "int4", "topk", "sparseloco", "dct-topk",
                                  "fp4"])
def test_error_feedback_loses_nothing_over_rounds(name):
    """The DiLoCo loop: each round sends encode(g_t + e_t) and keeps e_{t+1} = the rest on the node.
    Σ transmitted + the last residual = Σ g_t: what a round drops is sent later, never lost."""
    codec = make_codec(name, topk_fraction=0.02)
    g = torch.Generator().manual_seed(5)
    residual, sent, total = torch.zeros(500), torch.zeros(500), torch.zeros(500)
    for _ in range(30):
        grad = torch.randn(500, generator=g)
        total += grad
        _, decoded = encode_with_feedback(codec, grad + residual, residual)
        sent += decoded
    torch.testing.assert_close(sent + residual, total, atol=1e-4, rtol=0)
    if name in ("topk", "sparseloco", "dct-topk"):  # the residual stays bounded: what is dropped is sent eventually
        assert residual.abs().max() < 30 * grad.abs().max()
