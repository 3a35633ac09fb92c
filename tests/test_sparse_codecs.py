"""Issue 26's codecs: SparseLoCo (per-chunk top-k in b bits), DeMo's DCT top-k and FP4 E3M0; their exact
payload sizes, error bounds, error feedback, refusal of what the encoder never sends, and --value-bits."""
import math

import pytest
import torch

from p2ptrain import cli
from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.algorithms.diloco import DiLoCo, DiLoCoOptions
from p2ptrain.compression import (
    CODEC_NAMES,
    CODECS,
    NEEDS_ERROR_FEEDBACK,
    VALUE_BITS,
    CompressionError,
    DctTopK,
    Fp4,
    Halves,
    SparseLoCo,
    dct_basis,
    encode_with_feedback,
    get_codec,
    make_codec,
)
from p2ptrain.compression import codecs as codecs_module
from p2ptrain.settings import ConfigError, NodeConfig

torch.set_num_threads(1)

SIZES = (1, 255, 256, 257, 4095, 4096, 4097, 10000)
NEW = ("sparseloco", "dct-topk", "fp4")


def _randn(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def _roundtrip(codec, x):
    enc = codec.encode(x)
    return enc, codec.decode(enc.payload, enc.params, enc.shape, enc.dtype)


def _chunks(n: int, length: int) -> list[tuple[int, int]]:
    return [(s, min(s + length, n)) for s in range(0, n, length)]


# -- all three alike -------------------------------------------------------------------------------
def test_names_wire_ids_and_flags_stay_in_step():
    assert CODEC_NAMES[-3:] == NEW and all(name in CODECS for name in NEW)
    assert (CODECS["sparseloco"].wire_id, CODECS["dct-topk"].wire_id, CODECS["fp4"].wire_id) == (
        pb.CODEC_SPARSELOCO, pb.CODEC_DCT_TOPK, pb.CODEC_FP4)
    assert {"sparseloco", "dct-topk"} <= set(NEEDS_ERROR_FEEDBACK) and "fp4" not in NEEDS_ERROR_FEEDBACK
    assert VALUE_BITS == codecs_module.VALUE_BITS  # the torch-free list the flag checks against


@pytest.mark.parametrize("name", NEW)
@pytest.mark.parametrize("shape", [(10,), (3, 4, 5), (0,), (2, 0, 3), (), (70, 100)])
def test_shapes_dtypes_and_payload_bytes(name, shape):
    codec = CODECS[name]
    x = torch.randn(shape)
    enc, y = _roundtrip(codec, x)
    assert y.shape == x.shape and y.dtype == torch.float32 and enc.dtype == torch.float32
    assert enc.nbytes == codec.payload_bytes(x.numel()) and len(enc.params) == codec.param_count
    assert codec.decode(enc.payload, enc.params, enc.shape, torch.float64).dtype == torch.float64


@pytest.mark.parametrize("name,fraction,bits", [("sparseloco", 0.01, 2), ("sparseloco", 0.3, 3), ("sparseloco", 1.0, 8),
                                                ("sparseloco", 0.05, 32), ("dct-topk", 0.01, 1),
                                                ("dct-topk", 0.1, 2), ("dct-topk", 0.5, 7), ("dct-topk", 1.0, 32),
                                                ("fp4", None, None)])
def test_payload_size_is_an_exact_function_of_numel(name, fraction, bits):
    codec = make_codec(name, topk_fraction=fraction, value_bits=bits)
    for n in SIZES:
        enc = codec.encode(_randn(n, n))
        assert enc.payload.numel() * enc.payload.element_size() == enc.nbytes == codec.payload_bytes(n), n


def test_payload_sizes_by_hand():
    # sparseloco, f 0.01, 2 bits, 10000 = 4096 + 4096 + 1808: k = 41, 41, 19 (K = 101);
    # 3 float32 scales + 101 int16 indices + ceil(202 / 8) code bytes
    assert make_codec("sparseloco", topk_fraction=0.01, value_bits=2).payload_bytes(10000) == 12 + 202 + 26
    assert make_codec("sparseloco", topk_fraction=0.01, value_bits=32).payload_bytes(10000) == 101 * 4 + 101 * 2
    # dct-topk, f 0.01: 39 chunks of 256 keep ceil(2.56) = 3, the last 16 keep 1 (K = 118); uint8 indices
    assert make_codec("dct-topk", topk_fraction=0.01, value_bits=2).payload_bytes(10000) == 40 * 4 + 118 + 30
    assert make_codec("dct-topk", topk_fraction=0.01, value_bits=1).payload_bytes(10000) == 40 * 4 + 118 + 15
    assert get_codec("fp4").payload_bytes(10000) == 5000 and get_codec("fp4").payload_bytes(10001) == 5001
    codec = SparseLoCo(0.01, 2)
    assert codec.groups(10000) == [(2, 4096, 41), (1, 1808, 19)] and codec.groups(0) == []
    assert codec.payload_bytes(4096) == 4 + 82 + 11  # 1/169 of float32 at the defaults


@pytest.mark.parametrize("name", NEW)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_and_non_float32_input_rejected(name, bad):
    x = _randn(5000)
    x[[3, 4500]] = bad
    with pytest.raises(CompressionError, match="NaN/Inf") as exc:
        CODECS[name].encode(x)
    assert "2 non-finite of 5000" in str(exc.value)
    with pytest.raises(CompressionError, match="float64"):
        CODECS[name].encode(torch.ones(4, dtype=torch.float64))


@pytest.mark.parametrize("name", NEW)
def test_decode_refuses_wrong_sizes_and_params(name):
    codec = CODECS[name]
    enc = codec.encode(_randn(5000))
    with pytest.raises(CompressionError, match="bytes"):
        codec.decode(enc.payload[:-1], enc.params, (5000,))
    with pytest.raises(CompressionError, match="bytes"):
        codec.decode(enc.payload, enc.params, (5000 + 4096,))  # one more chunk (fp4: 2048 more bytes)
    for params in ((), (*enc.params, 1.0)):
        with pytest.raises(CompressionError, match="param"):
            codec.decode(enc.payload, params, (5000,))
    with pytest.raises(CompressionError, match="param"):
        codec.decode(enc.payload, ("x",) * codec.param_count, (5000,))
    with pytest.raises(CompressionError, match="floating"):
        codec.decode(enc.payload, enc.params, (5000,), torch.int32)


@pytest.mark.parametrize("name", NEW)
def test_any_codec_object_decodes_raw_wire_bytes(name):
    """The receiver decodes with get_codec(header.codec) and a uint8 buffer: f and b come with the
    codec params, so a codec made with other flags (or the defaults) reads the same tensor."""
    codec = make_codec(name, topk_fraction=0.07, value_bits=3)
    x = _randn(9000, 3).reshape(90, 100)
    enc = codec.encode(x)
    wire = torch.frombuffer(bytearray(enc.payload.numpy().tobytes()), dtype=torch.uint8)
    direct = codec.decode(enc.payload, enc.params, enc.shape)
    assert torch.equal(get_codec(enc.codec).decode(wire, list(enc.params), list(enc.shape)), direct)
    assert torch.equal(make_codec(name, topk_fraction=0.5, value_bits=8).decode(wire, enc.params, (90, 100)), direct)


# -- SparseLoCo ------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("fraction,numel", [(0.01, 10000), (0.05, 4097), (0.3, 4095), (1.0, 5000), (0.01, 1)])
def test_sparseloco_keeps_each_chunks_top_k_within_its_quantization_bound(fraction, numel, bits):
    codec = make_codec("sparseloco", topk_fraction=fraction, value_bits=bits)
    x = _randn(numel, numel) * 10.0 ** (bits - 4)
    _, y = _roundtrip(codec, x)
    top = 2 ** bits - 1
    for start, end in _chunks(numel, 4096):
        chunk, out = x[start:end], y[start:end]
        k = math.ceil(fraction * (end - start))
        kept = out != 0  # no level is zero: exactly the kept entries are non-zero
        assert int(kept.sum()) == k
        assert torch.equal(kept.nonzero().flatten().sort().values,
                           chunk.abs().topk(k).indices.sort().values)  # the true top-k of the chunk
        scale = chunk.abs().max()  # the largest entry is always kept, so s = max |chunk|
        assert (out[kept] - chunk[kept]).abs().max() <= scale / top * (1 + 1e-6)
        assert torch.equal(out[~kept], torch.zeros_like(out[~kept]))  # dropped entries: exactly 0
        # decoded values sit on the 2^b levels (2c - L) / L s: odd multiples of s / L
        on_grid = out[kept] / scale * top
        assert torch.allclose(on_grid, on_grid.round(), atol=1e-4) and (on_grid.round() % 2 == 1).all()


def test_sparseloco_payload_layout_by_hand():
    """One chunk of 4, f = 1, 2 bits: s = 3, v / s = 1, -1/3, 1/6, -1 -> codes 3, 1, 2, 0 (levels
    -1, -1/3, 1/3, 1), packed least significant bit first into 3 | 1 << 2 | 2 << 4 | 0 << 6 = 39."""
    codec = make_codec("sparseloco", topk_fraction=1.0, value_bits=2)
    enc, y = _roundtrip(codec, torch.tensor([3.0, -1.0, 0.5, -3.0]))
    raw = enc.payload
    assert enc.params == (1.0, 2.0) and enc.nbytes == 4 + 4 * 2 + 1
    assert raw[:4].view(torch.float32).item() == 3.0
    assert raw[4:12].view(torch.int16).tolist() == [0, 1, 2, 3] and raw[12:].tolist() == [39]
    assert y.tolist() == [3.0, -1.0, 1.0, -3.0]  # 0.5 goes to the nearest level, 1/3 s = 1


def test_sparseloco_32_bit_values_are_exact_chunked_top_k():
    codec = make_codec("sparseloco", topk_fraction=0.02, value_bits=32)
    x = _randn(10000, 9)
    _, y = _roundtrip(codec, x)
    kept = y != 0
    assert torch.equal(y[kept], x[kept]) and int(kept.sum()) == 82 + 82 + 37


def test_sparseloco_all_zero_and_sparse_chunks():
    codec = make_codec("sparseloco", topk_fraction=0.01, value_bits=2)
    zeros = torch.zeros(5000)
    enc, y = _roundtrip(codec, zeros)
    assert torch.equal(y, zeros) and enc.payload[:8].view(torch.float32).tolist() == [0.0, 0.0]
    x = torch.zeros(4096)
    x[[5, 77]] = torch.tensor([2.0, -1.0])  # fewer non-zeros than k = 41: the zeros kept decode to ±s/3
    _, y = _roundtrip(codec, x)
    assert y[5] == 2.0 and (y - x).abs().max() <= 2.0 / 3 * (1 + 1e-6)


# -- DCT top-k -------------------------------------------------------------------------------------
@pytest.mark.parametrize("length", [1, 2, 16, 255, 256])
def test_dct_basis_is_the_orthonormal_dct_ii(length):
    basis = dct_basis(length).double()
    n = torch.arange(length, dtype=torch.float64)
    k = n.unsqueeze(1)
    expected = torch.cos(math.pi * (n + 0.5) * k / length) * torch.where(k == 0, math.sqrt(1 / length),
                                                                           math.sqrt(2 / length))
    torch.testing.assert_close(basis, expected, atol=1e-7, rtol=0)
    torch.testing.assert_close(basis @ basis.T, torch.eye(length, dtype=torch.float64), atol=1e-6, rtol=0)
    assert dct_basis(length) is dct_basis(length)  # cached


@pytest.mark.parametrize("numel", SIZES)
def test_dct_topk_keeping_every_coefficient_as_float32_is_the_identity(numel):
    codec = make_codec("dct-topk", topk_fraction=1.0, value_bits=32)
    x = _randn(numel, numel)
    _, y = _roundtrip(codec, x)
    assert (y - x).abs().max() <= 1e-5


@pytest.mark.parametrize("bits", [1, 2, 8, 32])
@pytest.mark.parametrize("fraction,numel", [(0.01, 10000), (0.05, 4097), (0.25, 300)])
def test_dct_topk_keeps_each_chunks_top_k_coefficients(fraction, numel, bits):
    """In the DCT domain the decoded chunk holds the k largest coefficients of the input chunk, each
    within s / L of the truth (exact to float rounding at 32 bits), and nothing else; since the
    basis is orthonormal, the chunk's L2 error is that of its coefficients."""
    codec = make_codec("dct-topk", topk_fraction=fraction, value_bits=bits)
    x = _randn(numel, 4)
    _, y = _roundtrip(codec, x)
    top = 2 ** bits - 1
    for start, end in _chunks(numel, 256):
        basis = dct_basis(end - start).double()
        truth, got = basis @ x[start:end].double(), basis @ y[start:end].double()
        k = math.ceil(fraction * (end - start))
        index = truth.abs().topk(k).indices
        dropped = torch.ones(end - start, dtype=torch.bool)
        dropped[index] = False
        assert got[dropped].abs().max() <= 1e-5 if dropped.any() else True
        bound = 1e-5 if bits == 32 else truth[index].abs().max().item() / top * (1 + 1e-5) + 1e-5
        assert (got[index] - truth[index]).abs().max() <= bound
        l2 = (y[start:end].double() - x[start:end].double()).norm()
        torch.testing.assert_close(l2, (got - truth).norm(), atol=1e-4, rtol=1e-4)


def test_dct_topk_sign_variant_sends_plus_or_minus_the_chunk_scale():
    codec = make_codec("dct-topk", topk_fraction=4 / 256, value_bits=1)
    x = _randn(2560, 6)
    _, y = _roundtrip(codec, x)
    for start, end in _chunks(2560, 256):
        truth, got = dct_basis(256).double() @ x[start:end].double(), dct_basis(256).double() @ y[start:end].double()
        index = truth.abs().topk(4).indices
        scale = truth[index].abs().max()
        torch.testing.assert_close(got[index], truth[index].sign() * scale, atol=1e-5, rtol=0)


# -- FP4 E3M0 --------------------------------------------------------------------------------------
def test_fp4_codes_are_zero_and_seven_powers_of_two():
    """Nibble sign << 3 | e: e = 0 is zero, e = 1..7 is 2^(e-7) s; byte b holds nibbles b & 15, b >> 4."""
    fp4 = get_codec("fp4")
    payload = torch.arange(256, dtype=torch.uint8)
    y = fp4.decode(payload, (8.0,), (512,)).reshape(256, 2)
    table = [0.0] + [8.0 * 2.0 ** (e - 7) for e in range(1, 8)]
    expected = torch.tensor(table + [-v for v in table])
    byte = torch.arange(256)
    assert torch.equal(y[:, 0], expected[byte & 15]) and torch.equal(y[:, 1], expected[byte >> 4])


@pytest.mark.parametrize("mag", [1e-30, 1e-3, 1.0, 1e5, 1e30])
def test_fp4_error_is_within_a_third_of_x_or_two_to_the_minus_seven_of_the_scale(mag):
    fp4 = get_codec("fp4")
    x = _randn(10001, 2) * mag
    enc, y = _roundtrip(fp4, x)
    (scale,) = enc.params
    assert scale == x.abs().max().item() and enc.nbytes == 5001
    bound = torch.maximum(x.abs() / 3, torch.full_like(x, scale * 2.0 ** -7)) * (1 + 1e-6)
    assert ((y - x).abs() <= bound).all()
    assert (y.sign() * x.sign() >= 0).all()  # never the wrong sign
    ratio = (y.abs() / scale)[y != 0]
    assert torch.equal(ratio, torch.exp2(torch.log2(ratio).round()))  # powers of two times s
    exact = torch.tensor([-2.0, 1.5, -1.0, 0.75, 2.0 ** -6, 2.0 ** -7, 2.0 ** -8, 0.0, 0.2, -0.7])
    _, y = _roundtrip(fp4, exact)  # s = 2; ties go up: 1.5 -> 2, 0.75 -> 1, 2^-6 = 2^-7 s -> 2^-6 s
    assert y.tolist() == [-2.0, 2.0, -1.0, 1.0, 2.0 ** -5, 0.0, 0.0, 0.0, 0.25, -0.5]  # below 2^-7 s: 0


def test_fp4_all_zeros_and_bad_scales():
    fp4 = get_codec("fp4")
    enc, y = _roundtrip(fp4, torch.zeros(7))
    assert enc.params == (0.0,) and torch.equal(y, torch.zeros(7))
    for params in ((-1.0,), (float("nan"),), (float("inf"),)):
        with pytest.raises(CompressionError, match="scale"):
            fp4.decode(enc.payload, params, (7,))


# -- refused payloads of the chunked codecs --------------------------------------------------------
def _forge(codec, x, edit):
    enc = codec.encode(x)
    raw = enc.payload.clone()
    edit(raw)
    return raw, enc.params


@pytest.mark.parametrize("name", ["sparseloco", "dct-topk"])
def test_chunked_codecs_refuse_forged_payloads(name):
    codec = make_codec(name, topk_fraction=0.01, value_bits=2)
    chunk = codec.CHUNK
    n = 2 * chunk + 100  # two full chunks, a last one of 100
    x = _randn(n, 5)
    width = codec.INDEX_DTYPE.itemsize
    k_full, k_tail = codec.kept(chunk), codec.kept(100)
    first_index = 3 * 4  # after the 3 chunk scales

    def scale(value):
        return lambda raw: raw[:4].copy_(torch.tensor([value], dtype=torch.float32).view(torch.uint8))

    def index(position, value):
        at = first_index + position * width
        return lambda raw: raw[at:at + width].copy_(torch.tensor([value], dtype=codec.INDEX_DTYPE).view(torch.uint8))

    last = 2 * k_full  # the tail chunk's first index
    cases = [(scale(float("nan")), "scales"), (scale(float("inf")), "scales"), (scale(-1.0), "scales"),
             (index(last, 100), "ascending"), (index(last, chunk - 1), "ascending"),  # beyond the 100 of the tail
             (index(1, 0), "ascending"), (index(0, chunk - 1), "ascending")]  # duplicate / descending in chunk 0
    if name == "sparseloco":
        cases.append((index(0, -1), "ascending"))
    assert k_tail >= 1
    for edit, match in cases:
        raw, params = _forge(codec, x, edit)
        with pytest.raises(CompressionError, match=match):
            codec.decode(raw, params, (n,))
    enc = codec.encode(x)
    for params, match in [((0.0, 2.0), "fraction"), ((1.5, 2.0), "fraction"), ((float("nan"), 2.0), "fraction"),
                          ((0.01, 0.0), "bits"), ((0.01, 9.0), "bits"), ((0.01, 2.5), "bits"),
                          ((0.01, float("nan")), "bits"), ((0.01, 16.0), "bits"), ((0.02, 2.0), "bytes"),
                          ((0.01, 3.0), "bytes")]:
        with pytest.raises(CompressionError, match=match):
            codec.decode(enc.payload, params, (n,))


@pytest.mark.parametrize("name", ["sparseloco", "dct-topk"])
def test_float32_values_must_be_finite(name):
    codec = make_codec(name, topk_fraction=0.01, value_bits=32)
    raw, params = _forge(codec, _randn(1000), lambda raw: raw[:4].copy_(
        torch.tensor([float("nan")], dtype=torch.float32).view(torch.uint8)))
    with pytest.raises(CompressionError, match="non-finite"):
        codec.decode(raw, params, (1000,))


@pytest.mark.parametrize("kind", [SparseLoCo, DctTopK])
def test_constructors_and_make_codec_check_fraction_and_bits(kind):
    for bad in (0.0, -0.1, 1.5, float("nan"), True):
        with pytest.raises(CompressionError, match="fraction"):
            kind(bad, 2)
    for bad in (0, 9, 16, 2.5, True):
        with pytest.raises(CompressionError, match="bits"):
            kind(0.01, bad)
    made = make_codec(kind.name, topk_fraction=0.2, value_bits=4)
    assert isinstance(made, kind) and (made.fraction, made.value_bits) == (0.2, 4)
    assert make_codec(kind.name) is CODECS[kind.name] and (CODECS[kind.name].fraction, CODECS[kind.name].value_bits) \
        == (0.01, 2)
    assert make_codec(kind.name, value_bits=1).fraction == 0.01
    assert make_codec(kind.name, topk_fraction=0.5).value_bits == 2
    assert isinstance(make_codec("fp4", topk_fraction=0.5, value_bits=3), Fp4)  # fp4 takes neither


# -- error feedback --------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [1, 2, 8, 32])
def test_sparseloco_feedback_residual_plus_transmitted_is_the_input_exactly(bits):
    """Dropped entries leave whole (residual = x, decoded 0); a kept one's x - decoded is exact by
    Sterbenz wherever its level is within a factor 2 of x: |x| >= s / (2 L), which the top 5% of
    Gaussian chunks meet for b >= 2; at 1 bit (levels ±s) only to one rounding."""
    codec = make_codec("sparseloco", topk_fraction=0.05, value_bits=bits)
    x = _randn(10000, bits)
    residual = torch.full_like(x, 123.0)  # overwritten, not added to
    encoded, decoded = encode_with_feedback(codec, x, residual)
    if bits > 1:
        assert torch.equal(decoded + residual, x)
    assert ((decoded + residual - x).abs() <= (x.abs() + residual.abs()) * 2.0 ** -24).all()
    assert torch.equal(decoded, codec.decode(encoded.payload, encoded.params, (10000,)))
    dropped = decoded == 0
    assert torch.equal(residual[dropped], x[dropped]) and int((~dropped).sum()) == 205 + 205 + 91
    if bits == 32:
        assert torch.equal(residual[~dropped], torch.zeros(501))


@pytest.mark.parametrize("name,bits", [("dct-topk", 2), ("dct-topk", 32), ("fp4", None)])
def test_dense_feedback_residual_plus_transmitted_is_the_input_to_rounding(name, bits):
    """dct-topk's and fp4's decoded tensors are dense: x - decoded is rounded once, so the identity
    holds to one rounding (exactly where decoded is 0 or within a factor 2 of x)."""
    codec = make_codec(name, topk_fraction=0.05, value_bits=bits)
    x = _randn(10000, 11)
    residual = torch.empty_like(x)
    encoded, decoded = encode_with_feedback(codec, x, residual)
    assert torch.equal(residual, x - codec.decode(encoded.payload, encoded.params, (10000,)))
    assert ((decoded + residual - x).abs() <= (x.abs() + residual.abs()) * 2.0 ** -24).all()
    assert (decoded + residual == x).float().mean() > 0.5


@pytest.mark.parametrize("name,bits", [("sparseloco", 2), ("sparseloco", 1), ("dct-topk", 2), ("dct-topk", 1),
                                       ("fp4", None)])
def test_feedback_over_steps_transmits_the_sum(name, bits):
    """The DiLoCo loop: each step sends encode(g_t + e_t) and keeps e_{t+1} = the rest. Σ transmitted
    + the last residual = Σ g_t, and the residual stays bounded: what is dropped goes out later."""
    codec = make_codec(name, topk_fraction=0.05, value_bits=bits)
    g = torch.Generator().manual_seed(5)
    n, steps = 5000, 40
    residual, sent, total = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    for _ in range(steps):
        grad = torch.randn(n, generator=g)
        total += grad
        _, decoded = encode_with_feedback(codec, grad + residual, residual)
        sent += decoded
    torch.testing.assert_close(sent + residual, total, atol=2e-4, rtol=0)
    # bounded: well below the Σ |g| a codec that never sent an entry would leave behind (~ 0.8 steps)
    assert residual.abs().max() < 0.5 * steps
    assert residual.norm() < 0.25 * total.abs().sum() / n * math.sqrt(n) * steps ** 0.5


# -- the flag --------------------------------------------------------------------------------------
def test_value_bits_flag_reaches_the_options_and_the_codec():
    args = cli.build_parser().parse_args(["node", "--algorithm", "diloco", "--inner-steps", "10", "--compression",
                                          "sparseloco", "--value-bits", "3", "--topk-fraction", "0.05"])
    config = cli.config_from_args(args)
    options = config.algorithm_options
    assert (options.compression, options.value_bits, options.topk_fraction) == ("sparseloco", 3, 0.05)
    assert cli.build_parser().parse_args(["node"]).value_bits is None  # not given: TOML/env may set it
    default = NodeConfig.from_sources(env={}, flags=dict(algorithm="diloco", inner_steps=10)).validate()
    assert default.algorithm_options.value_bits == 2 and default.fingerprint() != config.fingerprint()
    algo = DiLoCo(type("Comm", (), {"rank": 0, "world_size": 1})(), inner_steps=10, compression="dct-topk",
                  topk_fraction=0.05, value_bits=1)
    assert (algo.codec_name, algo.topk_fraction, algo.value_bits) == ("dct-topk", 0.05, 1)


@pytest.mark.parametrize("bits", [0, 9, 16, -1])
def test_value_bits_out_of_range_refused(bits):
    with pytest.raises(ValueError, match="value_bits"):
        DiLoCoOptions(inner_steps=10, value_bits=bits).validate(None)


def test_which_algorithms_take_the_new_codecs():
    for name in ("sparseloco", "dct-topk", "fp4"):
        NodeConfig.from_sources(env={}, flags=dict(algorithm="diloco", compression=name)).validate()
    for name in ("sparseloco", "dct-topk"):  # on the pseudo-gradient half of the shares
        NodeConfig.from_sources(env={}, flags=dict(algorithm="gossip-diloco", compression=name)).validate()
    for name in ("fp4", "int4", "topk"):
        with pytest.raises(ConfigError, match="would drown"):
            NodeConfig.from_sources(env={}, flags=dict(algorithm="gossip-diloco", compression=name)).validate()
    for algorithm in ("allreduce", "pipesgd"):
        NodeConfig.from_sources(env={}, flags=dict(algorithm=algorithm, compression="fp4")).validate()
        for name in ("sparseloco", "dct-topk"):
            with pytest.raises(ConfigError, match="error feedback"):
                NodeConfig.from_sources(env={}, flags=dict(algorithm=algorithm, compression=name)).validate()
    with pytest.raises(ConfigError, match="sparseloco"):
        NodeConfig.from_sources(env={}, flags=dict(algorithm="sgp", share_compression="sparseloco")).validate()
    NodeConfig.from_sources(env={}, flags=dict(algorithm="sgp", share_compression="fp4")).validate()


# -- halves: gossip-DiLoCo's shares, dense anchors and sparse pseudo-gradients -----------------------
@pytest.mark.parametrize("numel", [2, 74, 8192 * 2 + 6])
def test_halves_is_its_two_codecs_side_by_side(numel):
    x = _randn(numel, seed=3)
    x[: numel // 2] += 5.0  # anchors: large; pseudo-gradients: small
    dense, sparse = get_codec("int8"), make_codec("sparseloco", topk_fraction=0.02, value_bits=2)
    codec = Halves(dense, sparse)
    enc, out = _roundtrip(codec, x)
    split = numel // 2
    a, b = _roundtrip(dense, x[:split])[1], _roundtrip(sparse, x[split:])[1]
    assert torch.equal(out, torch.cat([a, b]))  # each half exactly as its own codec decodes it
    assert enc.codec == pb.CODEC_HALVES and enc.nbytes == codec.payload_bytes(numel)
    assert len(enc.params) == codec.param_count == 2 + dense.param_count + sparse.param_count
    assert get_codec(pb.CODEC_HALVES).decode(enc.payload, enc.params, (numel,)).equal(out)  # any halves decodes
    if numel > 1000:  # the anchors keep their int8 bound; the deltas' own chunk scale, not the anchors'
        assert (out[:split] - x[:split]).abs().max() <= x[:split].abs().max() / 127
        assert torch.count_nonzero(out[split:]) == sum(math.ceil(0.02 * length) for _, length in
                                                       [(0, 4096), (0, 4096), (0, 3)])
    residual = torch.empty_like(x)
    _, decoded = encode_with_feedback(codec, x, residual)
    torch.testing.assert_close(decoded + residual, x, atol=1e-6, rtol=0)


def test_halves_refuses_what_its_encoder_never_sends():
    dense, sparse = get_codec("int8"), make_codec("sparseloco", topk_fraction=0.1)
    with pytest.raises(CompressionError, match="fixed size"):
        Halves(sparse, dense)
    with pytest.raises(CompressionError, match="neither may be halves"):
        Halves(dense, Halves(dense, sparse))
    enc = Halves(dense, sparse).encode(_randn(100))
    decode = get_codec(pb.CODEC_HALVES).decode
    for params in [(), (float(pb.CODEC_HALVES), *enc.params[1:]), (float(pb.CODEC_SPARSELOCO), *enc.params[1:]),
                   (*enc.params, 1.0), (math.nan, *enc.params[1:]), (99.0, *enc.params[1:]), enc.params[:2]]:
        with pytest.raises(CompressionError):
            decode(enc.payload, params, (100,))
    with pytest.raises(CompressionError):
        decode(enc.payload[:10], enc.params, (100,))  # cut short
    with pytest.raises(CompressionError):
        decode(torch.cat([enc.payload, enc.payload[:3]]), enc.params, (100,))  # too long
    with pytest.raises(CompressionError):
        decode(enc.payload.tolist(), enc.params, (100,))


# -- devices ---------------------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", NEW)
def test_cuda_decodes_the_same_bytes_to_the_same_bits(name):
    """sparseloco and fp4 also encode to the same bytes on a GPU; dct-topk's encoding is a matmul
    (summation order differs by device), but its decoding adds basis rows one by one, so the bytes
    a ring forwards decode to the same bits everywhere."""
    codec = make_codec(name, topk_fraction=0.02, value_bits=2)
    for seed in range(5):
        x = _randn(100003, seed) * 10.0 ** (seed - 2)
        on_cpu, on_gpu = codec.encode(x), codec.encode(x.cuda())
        assert on_gpu.payload.is_cuda and on_gpu.nbytes == on_cpu.nbytes
        if name != "dct-topk":
            assert on_gpu.params == on_cpu.params and torch.equal(on_gpu.payload.cpu(), on_cpu.payload), seed
        for enc in (on_cpu, on_gpu):
            back = codec.decode(enc.payload.cuda(), enc.params, enc.shape)
            assert back.is_cuda and torch.equal(back.cpu(), codec.decode(enc.payload.cpu(), enc.params, enc.shape))
