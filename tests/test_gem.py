"""GEM's worker rule (seed 001, Algorithm 1 / eq. 27) and its baselines, on hand-computed tensors;
the adaptive-staleness scaling as the parameter server applies it; the proxy run; GEM settings."""
from __future__ import annotations

import json
import math

import pytest
import torch

from p2ptrain._proto import p2ptrain_pb2 as pb
from p2ptrain.algorithms.gem import (
    DEFAULT_EPSILON,
    AdaptiveStalenessRule,
    DownpourRule,
    GemRule,
    build_rule,
    gem_pi,
    parse_clamp,
    pi_median,
    staleness_scale,
)
from p2ptrain.ps import ParameterServer, PsClient
from p2ptrain.ps.server import CentralVariable
from p2ptrain.settings import ConfigError, NodeConfig
from p2ptrain.transport.framing import tensor_bytes

torch.set_num_threads(1)

pytestmark = pytest.mark.timeout(60)


def t(*values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


# -- π of GEM ----------------------------------------------------------------------------------------
def test_pi_matches_the_formula_on_hand_computed_values():
    m = t(0.5, -0.2, 0.1, 0.0)
    delta = t(0.25, 0.1, -0.05, 0.2)
    theta = t(1.0, 2.0, -1.0, 0.5)
    s = t(0.75, 2.5, -1.0, 0.4)
    # κ = 2: π_i = (2|m_i| − |θ_i − s_i|) / (|Δθ_i| + ε), worked out by hand:
    # (1.0 − 0.25) / 0.25 = 3;  (0.4 − 0.5) / 0.1 = −1;  (0.2 − 0) / 0.05 = 4;  (0 − 0.1) / 0.2 = −0.5
    pi = gem_pi(m, delta, theta, s, kappa=2.0)
    assert pi.dtype == torch.float32
    torch.testing.assert_close(pi, t(3.0, -1.0, 4.0, -0.5))
    # the same through the default κ = 1, against the formula written out element by element
    pi1 = gem_pi(m, delta, theta, s)
    expected = [(abs(mi) - abs(ti - si)) / (abs(di) + DEFAULT_EPSILON)
                for mi, di, ti, si in zip(m.tolist(), delta.tolist(), theta.tolist(), s.tolist())]
    torch.testing.assert_close(pi1, torch.tensor(expected, dtype=torch.float32))


def test_gem_rule_keeps_the_first_moment_and_commits_pi_times_delta():
    rule = GemRule(kappa=1.0, momentum=0.5)
    s = t(0.0, 0.0, 0.0)
    theta = t(0.0, 0.1, -0.3)
    d1 = t(0.2, -0.4, 0.1)
    update, median = rule(d1, theta, s)
    m1 = d1  # m ← 0.5·0 + Δθ
    pi1 = (m1.abs() - (theta - s).abs()) / (d1.abs() + DEFAULT_EPSILON)
    torch.testing.assert_close(rule.m, m1)
    torch.testing.assert_close(update, pi1 * d1)
    assert median == pytest.approx(float(pi1.median()))
    d2 = t(0.1, 0.1, 0.1)
    theta2 = t(0.2, -0.3, 0.0)
    update2, _ = rule(d2, theta2, theta)
    m2 = 0.5 * m1 + d2
    torch.testing.assert_close(rule.m, m2)
    pi2 = (m2.abs() - (theta2 - theta).abs()) / (d2.abs() + DEFAULT_EPSILON)
    torch.testing.assert_close(update2, pi2 * d2)


def test_first_gem_step_without_drift_commits_the_update_itself():
    # m = Δθ and θ = s: π = |Δθ| / (|Δθ| + ε) = 1 in float32 for any update above ~1e-9
    delta = t(0.3, -1e-3, 5e-7, -2.0)
    update, median = GemRule()(delta, t(1, 2, 3, 4), t(1, 2, 3, 4))
    assert torch.equal(update, delta)
    assert median == 1.0


def test_pi_is_finite_for_zero_updates_and_the_update_is_exactly_zero_there():
    m = t(0.5, 0.0, 1e30, -1e30, 0.2)
    delta = t(0.0, 0.0, 0.0, 0.0, 0.1)
    theta, s = t(0, 0, 0, 0, 0), t(0.1, 0, 0, 0, 0)
    pi = gem_pi(m, delta, theta, s)
    assert torch.isfinite(pi).all()
    assert pi[0] == pytest.approx(0.4 / 1e-16, rel=1e-5)  # (|m| − |θ − s|) / ε: large but finite
    assert pi[1] == 0
    assert pi[2] == torch.finfo(torch.float32).max  # 1e30 / 1e-16 overflows float32: saturated, not inf
    rule = GemRule(momentum=0.0)
    rule.m = m.clone()
    update, median = rule(delta, theta, s)
    assert torch.isfinite(update).all()
    assert torch.equal(update[:4], torch.zeros(4))  # inf · 0 would have been NaN
    assert median == pytest.approx(float(rule.last_pi[4]))  # median over non-zero updates only


def test_epsilon_only_acts_on_vanishing_updates():
    eps = torch.tensor(DEFAULT_EPSILON, dtype=torch.float32)
    assert eps > 0 and eps == torch.tensor(1e-16, dtype=torch.float32)  # a normal float32
    for magnitude in (1e-8, 1e-3, 1.0):
        d = torch.tensor(magnitude, dtype=torch.float32)
        assert d + eps == d


def test_clamp_bounds_pi():
    m, delta = t(1.0, 0.0, 0.01), t(0.1, 0.1, 0.1)
    theta, s = t(0, 0.5, 0), t(0, 0, 0)
    raw = gem_pi(m, delta, theta, s)  # 10, −5, 0.1
    torch.testing.assert_close(raw, t(10.0, -5.0, 0.1))
    torch.testing.assert_close(gem_pi(m, delta, theta, s, clamp=(0.0, 5.0)), t(5.0, 0.0, 0.1))
    rule = GemRule(momentum=0.5, clamp=(0.0, 5.0))
    rule.m = t(1.8, 0.0, -0.18)  # m ← 0.5 m + Δθ = (1, 0.1, 0.01): π = (10, −4, 0.1) before clamping
    update, _ = rule(delta, theta, s)
    torch.testing.assert_close(rule.m, t(1.0, 0.1, 0.01))
    torch.testing.assert_close(update, t(0.5, 0.0, 0.01))


@pytest.mark.parametrize("text, expected", [(None, None), ("", None), ("none", None), ("0,5", (0.0, 5.0)),
                                            (" -1 , 2.5 ", (-1.0, 2.5)), ("3,3", (3.0, 3.0))])
def test_parse_clamp(text, expected):
    assert parse_clamp(text) == expected


@pytest.mark.parametrize("text", ["5", "1,2,3", "a,b", "5,0", "nan,1"])
def test_parse_clamp_rejects(text):
    with pytest.raises(ValueError):
        parse_clamp(text)


def test_pi_median_ignores_coordinates_without_update():
    pi = t(1e16, 2.0, 3.0, 4.0, 1e16)
    delta = t(0.0, 1.0, 1.0, 1.0, 0.0)
    assert pi_median(pi, delta) == 3.0
    assert math.isnan(pi_median(pi, torch.zeros(5)))


# -- baselines ------------------------------------------------------------------------------------
def test_downpour_commits_delta_with_pi_one():
    delta = t(0.1, -0.2, 0.0)
    update, median = DownpourRule()(delta, t(5, 5, 5), t(0, 0, 0))
    assert torch.equal(update, delta) and median == 1.0
    assert not DownpourRule.server_scales_by_staleness


def test_adaptive_staleness_is_scaled_by_the_server():
    rule = AdaptiveStalenessRule()
    delta = t(0.4, -0.8)
    update, median = rule(delta, t(1, 1), t(0, 0))
    assert torch.equal(update, delta) and math.isnan(median)  # the worker does not know τ
    assert rule.server_scales_by_staleness
    assert [staleness_scale(tau) for tau in (0, 1, 3)] == [1.0, 0.5, 0.25]
    with pytest.raises(ValueError):
        staleness_scale(-1)


def test_build_rule():
    assert isinstance(build_rule("gem", kappa=2.0, momentum=0.5), GemRule)
    assert isinstance(build_rule("downpour"), DownpourRule)
    assert isinstance(build_rule("adaptive-staleness"), AdaptiveStalenessRule)
    with pytest.raises(ValueError, match="proxy"):
        build_rule("proxy")
    with pytest.raises(ValueError, match="unknown policy"):
        build_rule("hogwild")
    with pytest.raises(ValueError, match="epsilon"):
        GemRule(epsilon=1e-40)  # subnormal in float32


def _commit(state: CentralVariable, worker: int, update: torch.Tensor, base: int, scaling: int, message_id: int):
    header = pb.TensorHeader(sender=worker, step=base, kind=pb.MESSAGE_KIND_PS_COMMIT, dtype=pb.DTYPE_FLOAT32,
                             numel=update.numel(), payload_bytes=update.numel() * 4, message_id=message_id,
                             commit_scaling=scaling)
    reception = state.open_commit(header)
    reception.write(tensor_bytes(update))
    return state.apply(reception)


def test_adaptive_staleness_applies_delta_over_tau_plus_one():
    state = CentralVariable(torch.zeros(3), workers=2)
    # worker 0 computed its update at version 0; three commits of worker 1 land first: τ = 3
    for i in range(3):
        _commit(state, 1, t(1.0, 1.0, 1.0), state.version, pb.COMMIT_SCALING_NONE, i + 1)
    before = state.theta.clone()
    delta = t(0.4, -0.8, 2.0)
    record = _commit(state, 0, delta, 0, pb.COMMIT_SCALING_STALENESS, 99)
    assert (record.staleness, record.scale) == (3, 0.25)
    torch.testing.assert_close(state.theta - before, delta / 4)
    # without staleness scaling (GEM / DOWNPOUR) the same τ leaves the update as sent
    record = _commit(state, 0, delta, 0, pb.COMMIT_SCALING_NONE, 100)
    assert (record.staleness, record.scale) == (4, 1.0)


def test_adaptive_staleness_over_grpc_reports_the_scale():
    with ParameterServer(torch.zeros(8), 2, listen="127.0.0.1:0", shutdown_grace=0.2) as server:
        address = f"127.0.0.1:{server.port}"
        with PsClient(address, 0, timeout=20) as w0, PsClient(address, 1, timeout=20) as w1:
            _, base = w0.pull()
            for _ in range(2):
                _, v = w1.pull()
                assert w1.commit(torch.ones(8), v).ack.status == pb.Ack.STATUS_ACCEPTED
            reply = w0.commit(torch.full((8,), 3.0), base, scaling=pb.COMMIT_SCALING_STALENESS)
            assert (reply.staleness, reply.scale, reply.version) == (2, pytest.approx(1 / 3), 3)
            theta, version = w0.pull()
        assert version == 3
        torch.testing.assert_close(theta, torch.full((8,), 2.0 + 1.0))


# -- the proxy --------------------------------------------------------------------------------------
def test_proxy_is_momentum_sgd_on_one_process_and_writes_the_node_files(tmp_path):
    from p2ptrain.ps.worker import run_proxy

    config = NodeConfig(role="worker", algorithm="gem", options={"ps_policy": "proxy"}, model="mlp", hidden=16,
                        num_train=600, num_test=200,
                        steps=40, batch_size=32, lr=0.05, log_every=10, out=str(tmp_path)).validate()
    summary = run_proxy(config)
    records = [json.loads(line) for line in (tmp_path / "node0.progress.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert [r["step"] for r in records if "step" in r] == [10, 20, 30, 40]
    assert losses[-1] < losses[0]
    assert records[-1] == {"rank": 0, "event": "done"}
    saved = json.loads((tmp_path / "node0.json").read_text())
    assert saved["policy"] == "proxy" and saved["test_accuracy"] == summary["test_accuracy"] > 0.2
    snaps = torch.load(tmp_path / "node0.snapshots.pt")
    assert snaps["steps"] == [0, 10, 20, 30, 40]


# -- settings ---------------------------------------------------------------------------------------
def test_gem_settings_defaults_and_sources(tmp_path):
    config = NodeConfig(algorithm="gem")
    options = config.algorithm_options
    assert (config.role, options.ps_policy, options.gem_kappa, options.gem_epsilon, options.gem_clamp) == (
        "peer", "gem", 1.0, 1e-16, "0,5")  # π clamped to [0, 5] as in the authors' code
    worker = {"P2PTRAIN_ROLE": "worker", "P2PTRAIN_PS_ADDRESS": "127.0.0.1:1"}
    assert NodeConfig.from_sources(env={"P2PTRAIN_GEM_CLAMP": "none", **worker}).algorithm_options.gem_clamp is None
    env = {"P2PTRAIN_ROLE": "worker", "P2PTRAIN_PS_ADDRESS": "ps:7000", "P2PTRAIN_GEM_CLAMP": "0,5",
           "P2PTRAIN_GEM_KAPPA": "2", "WORLD_SIZE": "16", "RANK": "3"}
    config = NodeConfig.from_sources(env=env)
    options = config.algorithm_options
    assert (config.role, config.ps_address, options.gem_clamp, options.gem_kappa, config.rank) == (
        "worker", "ps:7000", "0,5", 2.0, 3)
    assert config.peers == []  # a worker needs no peer list


WORKER = {"role": "worker", "ps_address": "a:1"}  # (the GEM options apply to parameter-server roles)


@pytest.mark.parametrize("flags, message", [
    ({"role": "boss"}, "unknown role 'boss'"),
    ({"role": "worker"}, "a worker needs --ps-address"),
    ({"role": "worker", "ps_address": "nohost"}, "ps_address 'nohost' is not host:port"),
    ({"role": "ps"}, "the parameter server needs --listen or --ps-address"),
    ({"role": "ps", "listen": "[::]:1", "ps_policy": "proxy"}, "proxy trains on one worker process"),
    ({"role": "worker", "ps_policy": "proxy", "world_size": 4}, "use --world-size 1"),
    ({**WORKER, "ps_policy": "hogwild"}, "unknown ps_policy 'hogwild'"),
    ({**WORKER, "gem_kappa": -1.0}, "gem_kappa must be a finite number >= 0"),
    ({**WORKER, "gem_epsilon": 0.0}, "gem_epsilon must be a normal float32"),
    ({**WORKER, "gem_epsilon": 1e-45}, "gem_epsilon must be a normal float32"),
    ({**WORKER, "gem_clamp": "5,0"}, "gem_clamp: clamp '5,0': need lo <= hi"),
    ({"gem_kappa": 2.0}, "--gem-kappa does not apply to sgp"),
    ({"role": "worker", "ps_address": "a:1", "momentum": 1.0}, "momentum μ must be < 1"),
])
def test_bad_gem_settings_raise_config_error(flags, message):
    with pytest.raises(ConfigError, match=message):
        NodeConfig.from_sources(env={}, flags=flags)


def test_cli_ps_and_worker_flags_reach_the_config():
    from p2ptrain import cli

    args = cli.build_parser().parse_args(["ps", "--world-size", "16", "--listen", "127.0.0.1:0"])
    assert args.func is cli.ps.run
    args = cli.build_parser().parse_args(
        ["node", "--role", "worker", "--ps", "127.0.0.1:7000", "--rank", "2", "--world-size", "4",
         "--ps-policy", "adaptive-staleness", "--gem-kappa", "1.5", "--gem-clamp", "0,5", "--gem-epsilon", "1e-12"])
    config = cli.config_from_args(args)
    options = config.algorithm_options
    assert (config.role, config.ps_address, options.ps_policy, options.gem_kappa, options.gem_clamp,
            options.gem_epsilon, config.rank, config.world_size) == (
        "worker", "127.0.0.1:7000", "adaptive-staleness", 1.5, "0,5", 1e-12, 2, 4)
