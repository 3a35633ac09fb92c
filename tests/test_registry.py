"""The algorithm registry and the import-weight promises that rest on it (issue 11)."""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.algorithms import registry
from p2ptrain.algorithms.base import Kind
from p2ptrain.settings import ConfigError, NodeConfig
from tests.conftest import ROOT, node_env


def test_import_and_help_load_no_torch():
    """`import p2ptrain`, the settings, the registry and the whole `p2ptrain --help` parser stay
    free of torch (and of gRPC), so the command answers at once."""
    code = ("import sys, p2ptrain, p2ptrain.cli as cli; p2ptrain.NodeConfig; cli.build_parser(); "
            "from p2ptrain.algorithms import registry; registry.algorithms(); "
            "print(sorted(m for m in ('torch', 'grpc') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], env=node_env(), cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_every_algorithm_is_registered_with_a_valid_spec():
    specs = registry.algorithms()
    assert list(specs) == ["allreduce", "diloco", "dpsgd", "gem", "gossip-diloco", "pipesgd", "relaysgd", "sgp"]
    for name, spec in specs.items():
        assert spec.name == name and spec.summary
        assert spec.role == "parameter-server" or spec.topologies, name
        options = spec.options()  # defaults
        options.validate(None)
        for f in dataclasses.fields(options):
            assert f.metadata["option"].help, f"{name}.{f.name} has no help"


def test_options_shared_by_several_algorithms_are_declared_alike():
    merged = registry.all_options()
    assert merged["compression"][1] == ("allreduce", "diloco", "gossip-diloco", "pipesgd")
    assert set(merged) >= {"overlap", "peers_per_step", "average", "warmup_steps", "ps_policy"}


def test_algorithm_kinds_are_the_wire_kinds():
    for kind in Kind:
        assert int(kind) == pb.MessageKind.Value(f"MESSAGE_KIND_{kind.name}")


def test_codec_names_match_the_codecs():
    from p2ptrain import compression

    assert set(compression.CODEC_NAMES) == set(compression.CODECS)
    assert compression.UNCOMPRESSED == pb.CODEC_NONE == compression.get_codec("none").wire_id
    assert compression.VOID == pb.CODEC_VOID  # (no codec: a header-only notice, PushSum.void)


def test_a_registered_algorithm_is_a_setting_a_flag_and_a_fingerprint_entry():
    """What one file plus one registry line buys: the option is a setting from every source, is
    validated by its own dataclass, and enters the fingerprint when it says so."""
    config = NodeConfig.from_sources(env={"P2PTRAIN_WARMUP_STEPS": "3"}, flags={"algorithm": "pipesgd"})
    assert config.algorithm_options.warmup_steps == 3
    assert config.fingerprint() != NodeConfig.from_sources(env={}, flags={"algorithm": "pipesgd"}).fingerprint()
    with pytest.raises(ConfigError, match="warmup_steps must be >= 0"):
        NodeConfig.from_sources(env={}, flags={"algorithm": "pipesgd", "warmup_steps": -2})


def test_a_bad_spec_is_refused_at_registration():
    @dataclasses.dataclass(frozen=True)
    class Loose(registry.AlgorithmOptions):
        knob: int = 3  # not declared with option(...)

    with pytest.raises(TypeError, match="option"):
        registry.register(registry.AlgorithmSpec("loose", "x", Loose, None, topologies=("ring",)))
    with pytest.raises(ValueError, match="registered twice"):
        registry.register(registry.AlgorithmSpec("sgp", "again", registry.get("sgp").options, None))
