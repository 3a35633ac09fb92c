"""NodeConfig sources and validation, and the CLI's help and configuration-error handling."""
from __future__ import annotations

import argparse

import pytest
import torch

from p2ptrain import cli
from p2ptrain.algorithms import registry
from p2ptrain.cli.flags import add_node_arguments
from p2ptrain.settings import SETTINGS, ConfigError, NodeConfig

torch.set_num_threads(1)

PEERS2 = "127.0.0.1:50051,127.0.0.1:50052"
# Every setting: those of NodeConfig's groups (the algorithm's options travel in `options`, whose names
# are the registry's; `ignored_options` and `rank_given` are bookkeeping) plus every algorithm option.
FIELDS = list(SETTINGS) + list(registry.all_options())


def write(tmp_path, text: str, name: str = "node.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


# -- sources and precedence ------------------------------------------------------------------------
def test_defaults_without_any_source():
    config = NodeConfig.from_sources(env={})
    assert config == NodeConfig()
    assert (config.rank, config.world_size, config.peers, config.algorithm_options.overlap, config.steps) == (
        0, 1, [], 0, 300)
    assert config.chunk_bytes == 4 * 1024 * 1024


def test_precedence_defaults_toml_env_flags(tmp_path):
    toml = write(tmp_path, 'steps = 10\noverlap = 1\nlr = 0.1\nhidden = 64\ntopology = "ring"\n')
    env = {"P2PTRAIN_STEPS": "20", "P2PTRAIN_OVERLAP": "2", "P2PTRAIN_TOPOLOGY": "complete"}
    flags = {"steps": 30, "topology": None, "command": "node", "func": print}  # None = flag not given
    config = NodeConfig.from_sources(toml_path=toml, env=env, flags=flags)
    assert config.steps == 30          # flag > env > TOML
    assert config.algorithm_options.overlap == 2         # env > TOML
    assert config.topology == "complete"  # a None flag does not override
    assert config.lr == 0.1 and isinstance(config.lr, float)  # TOML > default
    assert config.hidden == 64
    assert config.batch_size == 32     # default
    assert NodeConfig.from_sources(toml_path=toml, env={}).steps == 10
    assert NodeConfig.from_sources(toml_path=toml, env=env).steps == 20


def test_torchrun_env_and_peer_list():
    env = {"RANK": "1", "WORLD_SIZE": "3",
           "P2PTRAIN_PEERS": " node0:50051, node1:50051 ,node2:50051,"}
    config = NodeConfig.from_sources(env=env)
    assert (config.rank, config.world_size) == (1, 3)
    assert config.peers == ["node0:50051", "node1:50051", "node2:50051"]
    # P2PTRAIN_RANK is more specific than torchrun's RANK; flags beat both
    assert NodeConfig.from_sources(env={**env, "P2PTRAIN_RANK": "2"}).rank == 2
    assert NodeConfig.from_sources(env={**env, "P2PTRAIN_RANK": "2"}, flags={"rank": 0}).rank == 0


def test_env_values_are_coerced_to_field_types():
    env = {"P2PTRAIN_LR": "0.5", "P2PTRAIN_CHUNK_MB": "1", "P2PTRAIN_METRICS_PORT": "none",
           "P2PTRAIN_NUM_TRAIN": "1000", "P2PTRAIN_OUT": "runs/x", "P2PTRAIN_LISTEN": "127.0.0.1:7000"}
    config = NodeConfig.from_sources(env=env)
    assert config.lr == 0.5 and config.chunk_mb == 1.0 and config.chunk_bytes == 1024 * 1024
    assert config.metrics_port is None and config.num_train == 1000
    assert config.out == "runs/x" and config.listen == "127.0.0.1:7000"


def test_node_table_in_toml(tmp_path):
    toml = write(tmp_path, '[node]\nrank = 1\nworld_size = 2\npeers = ["a:1", "b:2"]\noverlap = 3\n'
                           'chunk_mb = 0.5\nmetrics_port = 0\n')
    config = NodeConfig.from_sources(toml_path=toml, env={})
    assert (config.rank, config.world_size, config.peers, config.algorithm_options.overlap) == (1, 2, ["a:1", "b:2"], 3)
    assert config.chunk_bytes == 512 * 1024 and config.metrics_port == 0


def test_top_level_keys_next_to_a_node_table_are_not_silently_ignored(tmp_path):
    toml = write(tmp_path, 'overlap = 2\n[node]\nsteps = 5\n')
    with pytest.raises(ConfigError, match="overlap"):
        NodeConfig.from_sources(toml_path=toml, env={})


def test_unknown_toml_key_is_named(tmp_path):
    toml = write(tmp_path, 'steps = 5\nlearning_rate = 0.1\n')
    with pytest.raises(ConfigError, match=r"unknown setting\(s\) \['learning_rate'\]"):
        NodeConfig.from_sources(toml_path=toml, env={})
    toml = write(tmp_path, '[node]\noverlapp = 1\n', "table.toml")
    with pytest.raises(ConfigError, match="overlapp"):
        NodeConfig.from_sources(toml_path=toml, env={})


def test_invalid_toml_and_missing_file(tmp_path):
    toml = write(tmp_path, 'steps = = 5\n')
    with pytest.raises(ConfigError, match="is not valid TOML"):
        NodeConfig.from_sources(toml_path=toml, env={})
    with pytest.raises(ConfigError, match="does not exist"):
        NodeConfig.from_sources(toml_path=tmp_path / "missing.toml", env={})


@pytest.mark.parametrize("sources, message", [
    ({"env": {"RANK": "2", "WORLD_SIZE": "2", "P2PTRAIN_PEERS": PEERS2}}, r"rank 2 outside 0\.\.1"),
    ({"flags": {"rank": -1}}, r"rank -1 outside 0\.\.0"),
    ({"flags": {"world_size": 0}}, "world_size must be >= 1, got 0"),
    ({"flags": {"world_size": 3, "peers": PEERS2}}, "--peers lists 2 addresses but world size is 3"),
    ({"flags": {"world_size": 2}}, "no --peers and no rendezvous: set --rendezvous HOST:PORT or run under torchrun"),
    ({"flags": {"world_size": 2, "peers": "foo,127.0.0.1:1"}}, "peer address 'foo' is not host:port"),
    ({"flags": {"world_size": 2, "peers": "127.0.0.1:1,127.0.0.1:99999"}},
     "peer address '127.0.0.1:99999' is not host:port"),
    ({"flags": {"world_size": 2, "peers": "a:1,a:1"}}, "peer addresses must be distinct"),
    ({"flags": {"algorithm": "easgd"}}, "unknown algorithm 'easgd'"),
    ({"flags": {"algorithm": "dpsgd", "topology": "exponential"}}, "dpsgd cannot run on topology 'exponential'"),
    ({"flags": {"algorithm": "relaysgd", "topology": "ring"}}, "relaysgd cannot run on topology 'ring'"),
    ({"flags": {"algorithm": "allreduce", "compression": "zip"}}, "unknown compression 'zip'"),
    ({"flags": {"algorithm": "allreduce", "average": "both"}}, "unknown average 'both'"),
    ({"flags": {"algorithm": "pipesgd", "warmup_steps": -1}}, "warmup_steps must be >= 0"),
    ({"flags": {"overlap": 1, "algorithm": "pipesgd"}}, "--overlap does not apply to pipesgd"),
    ({"flags": {"overlap": 1, "algorithm": "allreduce"}}, "overlap=1 overlaps the model average .* use --algorithm "
                                                          "pipesgd"),
    ({"flags": {"overlap": 2, "algorithm": "allreduce", "average": "models"}},
     r"allreduce overlap must be 0 \(synchronous\) or 1 .*, got 2"),
    ({"flags": {"topology": "torus"}}, "unknown topology 'torus'"),
    ({"flags": {"overlap": -1}}, "overlap τ must be >= 0, got -1"),
    ({"flags": {"overlap": 64}}, "overlap τ must be smaller than step_window"),
    ({"flags": {"chunk_mb": 100}}, r"chunk_mb must be within \[0.004, 64\], got 100"),
    ({"flags": {"chunk_mb": 0.001}}, r"chunk_mb must be within \[0.004, 64\], got 0.001"),
    ({"env": {"P2PTRAIN_STEPS": "abc"}}, "setting steps='abc' is not a valid int"),
    ({"env": {"WORLD_SIZE": "two"}}, "setting world_size='two' is not a valid int"),
    ({"env": {"P2PTRAIN_LR": "fast"}}, "setting lr='fast' is not a valid float"),
    ({"flags": {"model": "resnet"}}, "unknown model 'resnet'"),
    ({"flags": {"dataset": "mnist"}}, "--dataset mnist needs --data-dir"),
    ({"flags": {"device": "tpu"}}, "unknown device 'tpu'"),
    ({"flags": {"metrics_port": 70000}}, "metrics_port must be a port number"),
])
def test_bad_values_raise_config_error_naming_the_setting(sources, message):
    sources.setdefault("env", {})
    with pytest.raises(ConfigError, match=message):
        NodeConfig.from_sources(**sources)


@pytest.mark.parametrize("text, name", [
    ('steps = "abc"\n', "steps"),
    ("overlap = 1.5\n", "overlap"),   # a fractional int must not be truncated silently
    ("steps = true\n", "steps"),
])
def test_bad_toml_values_raise_config_error(tmp_path, text, name):
    with pytest.raises(ConfigError, match=f"setting {name}="):
        NodeConfig.from_sources(toml_path=write(tmp_path, text), env={})


def test_integral_float_in_toml_is_accepted_for_int(tmp_path):
    assert NodeConfig.from_sources(toml_path=write(tmp_path, "steps = 12.0\n"), env={}).steps == 12


def test_fingerprint_shared_settings_only():
    def config(**kw):
        base = dict(world_size=2, peers=["a:1", "b:2"])
        base.update(kw)
        return NodeConfig(**base).validate()

    base = config()
    assert len(base.fingerprint()) == 16
    assert base.fingerprint() == config(rank=1).fingerprint()
    assert base.fingerprint() == config(rank=1, peers=["c:3", "d:4"], listen="127.0.0.1:9").fingerprint()
    assert base.fingerprint() == config(out="x", metrics_port=0).fingerprint()
    assert base.fingerprint() != config(options={"overlap": 1}).fingerprint()
    assert base.fingerprint() != config(topology="ring").fingerprint()
    assert base.fingerprint() != config(seed=1).fingerprint()
    assert base.fingerprint() != config(world_size=3, peers=["a:1", "b:2", "c:3"]).fingerprint()


# -- CLI ---------------------------------------------------------------------------------------------
def _help(capsys, argv) -> str:
    with pytest.raises(SystemExit) as info:
        cli.build_parser().parse_args(argv)
    assert info.value.code == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    return captured.out


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@pytest.fixture(autouse=True)
def _plain_help(monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")
    monkeypatch.setenv("NO_COLOR", "1")
    for key in ("RANK", "WORLD_SIZE", *[f"P2PTRAIN_{f.upper()}" for f in FIELDS]):
        monkeypatch.delenv(key, raising=False)


@pytest.mark.parametrize("argv", [["--help"], ["node", "--help"], ["launch", "--help"], ["bench", "--help"],
                                  ["bench", "transport", "--help"]])
def test_every_help_works(capsys, argv):
    text = _help(capsys, argv)
    assert text.startswith("usage: p2ptrain")


def test_node_help_mentions_every_setting(capsys):
    text = _help(capsys, ["node", "--help"])
    missing = [f for f in FIELDS if _flag(f) not in text]
    assert missing == [], f"settings without a node flag: {missing}"
    assert "--config" in text
    # and the flag parser knows exactly the settings (plus --config)
    parser = argparse.ArgumentParser()
    add_node_arguments(parser)
    dests = set(vars(parser.parse_args([])))
    assert dests == set(FIELDS) | {"config_file"}


def test_launch_help_mentions_shared_settings(capsys):
    text = _help(capsys, ["launch", "--help"])
    per_node = {"rank", "world_size", "peers", "listen", "metrics_port", "metrics_host", "role", "ps_address",
                "rejoin", "join", "join_at", "rendezvous", "advertise", "run_id", "lane_port", "reachability"}
    missing = [f for f in FIELDS if f not in per_node and _flag(f) not in text]
    assert missing == []
    for flag in ("--nodes", "--timeout", "--no-metrics", "--live", "--no-live"):
        assert flag in text
    assert "--rank" not in text and "--peers " not in text


def test_top_help_lists_commands(capsys):
    text = _help(capsys, ["--help"])
    for command in ("node", "launch", "bench"):
        assert command in text


def test_node_flags_reach_the_config(tmp_path):
    args = cli.build_parser().parse_args(
        ["node", "--rank", "1", "--world-size", "2", "--peers", PEERS2, "--overlap", "2", "--chunk-mb", "0.25",
         "--config", str(write(tmp_path, "steps = 7\noverlap = 1\n"))])
    config = cli.config_from_args(args)
    assert (config.rank, config.world_size, config.algorithm_options.overlap, config.steps) == (1, 2, 2, 7)
    assert config.peers == PEERS2.split(",") and config.chunk_bytes == 256 * 1024


@pytest.mark.parametrize("argv, message", [
    (["node", "--rank", "5", "--world-size", "2", "--peers", PEERS2], "rank 5 outside 0..1"),
    (["node", "--world-size", "2", "--peers", "foo,127.0.0.1:1"], "peer address 'foo' is not host:port"),
    (["launch", "--nodes", "0"], "--nodes must be >= 1"),
    (["launch", "--nodes", "2", "--overlap", "-3"], "overlap τ must be >= 0, got -3"),
])
def test_main_reports_configuration_errors_without_traceback(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "p2ptrain: configuration error: " in err
    assert message in err
    assert "Traceback" not in err


def test_main_reports_bad_config_file(capsys, tmp_path):
    path = write(tmp_path, "bogus = 1\n")
    with pytest.raises(SystemExit) as info:
        cli.main(["node", "--config", str(path)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "configuration error" in err and "bogus" in err and "Traceback" not in err


def test_unparsable_flag_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["node", "--rank", "abc"])
    assert info.value.code == 2
    assert "invalid int value: 'abc'" in capsys.readouterr().err


def test_topology_defaults_per_algorithm_and_enters_the_fingerprint():
    from p2ptrain.settings import NodeConfig

    assert NodeConfig(algorithm="sgp").resolved_topology == "exponential"
    assert NodeConfig(algorithm="dpsgd").resolved_topology == "ring"
    assert NodeConfig(algorithm="relaysgd").resolved_topology == "double-binary-trees"
    assert NodeConfig(algorithm="dpsgd").fingerprint() == NodeConfig(algorithm="dpsgd", topology="ring").fingerprint()
    assert NodeConfig(algorithm="pipesgd").fingerprint() != NodeConfig(algorithm="pipesgd",
                                                                        options={"compression": "int8"}).fingerprint()
