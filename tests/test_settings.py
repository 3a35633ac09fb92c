"""The settings' structure: groups, flat names, the small languages, one list per set of names, and
what the settings hand to the transport and the launchers."""
from __future__ import annotations

import dataclasses

import pytest

from p2ptrain import choices
from p2ptrain.algorithms import registry
from p2ptrain.settings import SECTIONS, SETTINGS, ConfigError, NodeConfig, env_variables
from p2ptrain.settings.parsers import AtStep, LinkEntry, Slowdown
from p2ptrain.settings.sources import gather

PEERS2 = ["127.0.0.1:50051", "127.0.0.1:50052"]


# -- groups and flat names -------------------------------------------------------------------------
def test_every_setting_lives_in_exactly_one_group_and_reads_flat():
    owners: dict[str, list[str]] = {}
    for section, group in SECTIONS.items():
        for f in dataclasses.fields(group):
            owners.setdefault(f.name, []).append(section)
    assert {name: sections for name, sections in owners.items() if len(sections) != 1} == {}
    assert list(owners) == list(SETTINGS)
    config = NodeConfig(world_size=2, peers=PEERS2, steps=7, chunk_mb=1.0, tls_server_name="x", log_every=3)
    for name, setting in SETTINGS.items():
        assert getattr(config, name) is getattr(getattr(config, setting.section), name), name
        assert name not in SECTIONS and not callable(getattr(config, name)), name
    assert (config.training.steps, config.transport.chunk_mb, config.security.tls_server_name) == (7, 1.0, "x")


def test_node_config_is_frozen_and_replace_changes_by_flat_name():
    config = NodeConfig(world_size=2, peers=PEERS2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.steps = 5  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.training = config.training  # type: ignore[misc]
    moved = config.replace(rank=1, rank_given=False, steps=9)
    assert (moved.rank, moved.steps, moved.rank_given, moved.world_size) == (1, 9, False, 2)
    assert (config.rank, config.steps, config.rank_given) == (0, 300, True)  # the original is untouched
    assert moved.replace(rank_given=True).rank_given and moved.options == config.options


def test_groups_and_flat_names_compose_in_the_constructor():
    training = dataclasses.replace(NodeConfig().training, steps=11, model="cnn")
    config = NodeConfig(training=training, steps=12, world_size=1)
    assert (config.steps, config.model) == (12, "cnn")  # the flat name applies on top of the group
    with pytest.raises(TypeError, match="learning_rate"):
        NodeConfig(learning_rate=0.1)
    assert NodeConfig(algorithm="sgp", options={"overlap": 1}).algorithm_options.overlap == 1


def test_each_group_checks_its_own_settings_and_the_config_what_spans_groups():
    group = dataclasses.replace(NodeConfig().transport, chunk_mb=100.0)
    with pytest.raises(ConfigError, match="chunk_mb"):
        group.validate()
    with pytest.raises(ConfigError, match=r"slowdown '0=2,5=3': rank 5 is not in 0\.\.1"):
        NodeConfig(world_size=2, peers=PEERS2, slowdown="0=2,5=3").validate()  # its group alone cannot know
    NodeConfig(slowdown="0=2,5=3").faults.validate()


def test_idx_is_a_dataset_the_settings_take(tmp_path):
    assert "idx" in choices.DATASET_NAMES
    assert NodeConfig(dataset="idx", data_dir=str(tmp_path)).validate().dataset == "idx"
    with pytest.raises(ConfigError, match="--dataset idx needs --data-dir"):
        NodeConfig(dataset="idx").validate()


# -- one list per set of names ---------------------------------------------------------------------
def test_the_torch_side_tables_implement_exactly_the_names_the_settings_take():
    from p2ptrain.train import data, models, setup

    assert tuple(setup.OPTIMIZERS) == choices.OPTIMIZER_NAMES
    assert models.MODEL_NAMES == choices.MODEL_NAMES and data.DATASET_NAMES == choices.DATASET_NAMES
    for name in choices.MODEL_NAMES:  # every name builds (and nothing else does)
        assert models.build_model(name, (1, 28, 28), 10) is not None
    with pytest.raises(ValueError, match="unknown model"):
        models.build_model("resnet", (1, 28, 28), 10)


def test_a_settings_choice_type_is_its_flag_choices_and_its_list():
    import argparse

    from p2ptrain.cli.flags import add_node_arguments

    parser = argparse.ArgumentParser()
    choices_of = {a.dest: tuple(a.choices) for a in add_node_arguments(parser) if a.choices is not None}
    assert choices_of["role"] == choices.ROLE_NAMES and choices_of["device"] == choices.DEVICE_NAMES
    assert choices_of["data_plane"] == choices.DATA_PLANE_NAMES and choices_of["model"] == choices.MODEL_NAMES
    assert choices_of["dataset"] == choices.DATASET_NAMES and choices_of["optimizer"] == choices.OPTIMIZER_NAMES
    assert choices_of["algorithm"] == registry.names()


def test_parameter_server_roles_run_the_algorithm_the_registry_says_serves_them():
    serving = registry.algorithm_for_role("worker")
    assert serving is not None and registry.get(serving).role == "parameter-server"
    assert registry.algorithm_for_role("ps") == serving and registry.algorithm_for_role("peer") is None
    assert registry.runs_parameter_server(serving) and not registry.runs_parameter_server("sgp")
    assert not registry.runs_parameter_server(None) and not registry.runs_parameter_server("easgd")
    worker = NodeConfig.from_sources(env={}, flags={"role": "worker", "ps_address": "a:1"})
    assert worker.algorithm == serving


# -- the small languages ---------------------------------------------------------------------------
def test_slowdown_for_every_node_or_per_rank():
    assert Slowdown.parse("4").factors(3) == {0: 4.0, 1: 4.0, 2: 4.0}
    assert Slowdown.parse(" 0=4, 3=2 ").factors(4) == {0: 4.0, 3: 2.0}
    assert Slowdown.parse(None).factors(2) == {} and Slowdown.parse("").factors(2) == {}
    for bad, message in (("0.5", "must be >= 1"), ("x", "not a number"), ("2,3", "one FACTOR"),
                         ("a=2", "not a rank number"), ("0=inf", "must be >= 1")):
        with pytest.raises(ValueError, match=message):
            Slowdown.parse(bad)
    with pytest.raises(ValueError, match=r"rank 9 is not in 0\.\.1"):
        Slowdown.parse("9=2").factors(2)


def test_at_step_forms_and_one_line_errors():
    assert AtStep.parse("2@50") == AtStep(2, 50, None) == (2, 50, None)
    assert AtStep.parse("3@10:2.5", seconds=True) == (3, 10, 2.5)
    for text, kwargs, message in (("2@", {}, "expected RANK@STEP, e.g. 2@50"),
                                  ("x@1", {"number": "COUNT", "example": "2@100"}, "expected COUNT@STEP, e.g. 2@100"),
                                  ("2@5", {"seconds": True}, "expected RANK@STEP:SECONDS"),
                                  ("2@5:1", {}, "expected RANK@STEP"),
                                  ("2@5:soon", {"seconds": True}, "'soon' is not a number of seconds"),
                                  ("2@5:0", {"seconds": True}, "must last > 0 seconds")):
        with pytest.raises(ValueError, match=message) as info:
            AtStep.parse(text, **kwargs)
        assert "\n" not in str(info.value)


def test_link_entries_one_way_and_both_ways():
    assert LinkEntry.parse("0->3:1,2") == LinkEntry(0, 3, False, "1,2")
    assert LinkEntry.parse(" 2 <-> 1 :drop=0.1") == LinkEntry(2, 1, True, "drop=0.1")
    assert LinkEntry.parse("0=>1:x") is None and LinkEntry.parse("0->1") is None and LinkEntry.parse("a->1:x") is None


def test_inject_nan_names_a_rank_of_the_run():
    config = NodeConfig(world_size=2, peers=PEERS2, rank=1, inject_nan="1@7").validate()
    assert config.nan_injection_step == 7 and config.replace(rank=0).nan_injection_step is None
    for bad, message in (("5@3", "rank 5 outside 0..1"), ("1-3", "expected RANK@STEP, e.g. 2@50")):
        with pytest.raises(ConfigError, match=f"inject_nan '{bad}': {message}"):
            NodeConfig(world_size=2, peers=PEERS2, inject_nan=bad).validate()


# -- what the settings hand on ---------------------------------------------------------------------
def test_transport_options_take_every_transport_setting():
    from p2ptrain.transport import TransportOptions

    transport = dataclasses.replace(NodeConfig().transport, chunk_mb=1.0, peer_timeout=7.0, step_window=9,
                                    link_deadline=3.0, max_lag=5, relay_routes=["0->2:1"], relays="any",
                                    relay_retry_after=4.0, data_plane="grpc", lane_port=0)
    options = TransportOptions.from_settings(transport, view_notice=1.0)
    assert (options.chunk_bytes, options.send_timeout, options.step_window, options.link_deadline, options.max_lag,
            options.relay_routes, options.relays, options.relay_retry_after, options.data_plane, options.view_notice
            ) == (1 << 20, 7.0, 9, 3.0, 5, ("0->2:1",), "any", 4.0, "grpc", 1.0)
    assert TransportOptions.from_settings(transport, max_lag=12).max_lag == 12  # what the node derives wins
    unset = TransportOptions.from_settings(NodeConfig().transport)  # max_lag None: the option's own default
    assert unset.max_lag == TransportOptions().max_lag and unset.relays is None


def test_env_variables_read_back_as_the_same_settings():
    flags = {"world_size": 3, "peers": "a:1,b:2,c:3", "link_overrides": "0->1:latency=5ms;1<->2:drop=0.1",
             "relay_routes": "0->2:1", "join": False, "tls_require_client_cert": True, "overlap": 1, "steps": None,
             "auth_token": "secret"}
    env = env_variables(flags)
    assert "P2PTRAIN_AUTH_TOKEN" not in env and "P2PTRAIN_STEPS" not in env
    from_env = gather(toml_path=None, env=env, flags={})
    from_flags = gather(toml_path=None, env={}, flags={k: v for k, v in flags.items() if k != "auth_token"})
    assert from_env.settings == from_flags.settings and from_env.options == from_flags.options == {"overlap": 1}
    assert from_env.settings["link_overrides"] == ["0->1:latency=5ms", "1<->2:drop=0.1"]
