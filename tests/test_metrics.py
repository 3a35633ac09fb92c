"""NodeMetrics: exact values through a real /metrics HTTP endpoint on 127.0.0.1, and the address a
node's /metrics listens on (the host of --listen unless --metrics-host says otherwise)."""
from __future__ import annotations

import urllib.request

import pytest
import torch

from p2ptrain.metrics import STEP_SECONDS_BUCKETS, NodeMetrics

torch.set_num_threads(1)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def served():
    metrics = NodeMetrics(0, "sgp")
    server, thread = metrics.serve(0, addr="127.0.0.1")
    try:
        yield metrics, server.server_port
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    scrape.text = text
    return samples


def test_exposition_has_exact_values(served):
    metrics, port = served
    metrics.on_sent(1, 123)
    metrics.on_sent(1, 77)
    metrics.on_sent(2, 5)
    metrics.on_received(1, 4000)
    metrics.on_rejected("bad_dtype")
    metrics.on_rejected("bad_dtype")
    metrics.on_rejected("truncated")
    metrics.on_send_error(2)
    metrics.on_refused_send(1)
    metrics.on_step(1, 0.02, 2.5)
    metrics.on_step(2, 0.3, None)   # no loss: the gauge keeps the last one
    metrics.on_step(3, 20.0, 1.25)
    metrics.set_ps_weight(0.375)

    s = scrape(port)
    assert 'p2ptrain_sent_bytes_total{node="0",peer="1"} 200.0' in scrape.text
    assert s['p2ptrain_sent_bytes_total{node="0",peer="1"}'] == 200.0
    assert s['p2ptrain_sent_bytes_total{node="0",peer="2"}'] == 5.0
    assert s['p2ptrain_sent_messages_total{node="0",peer="1"}'] == 2.0
    assert s['p2ptrain_sent_messages_total{node="0",peer="2"}'] == 1.0
    assert s['p2ptrain_received_bytes_total{node="0",peer="1"}'] == 4000.0
    assert s['p2ptrain_received_messages_total{node="0",peer="1"}'] == 1.0
    assert s['p2ptrain_rejected_messages_total{node="0",reason="bad_dtype"}'] == 2.0
    assert s['p2ptrain_rejected_messages_total{node="0",reason="truncated"}'] == 1.0
    assert s['p2ptrain_send_errors_total{node="0",peer="2"}'] == 1.0
    assert s['p2ptrain_refused_sends_total{node="0",peer="1"}'] == 1.0
    assert s['p2ptrain_step_seconds_count{algorithm="sgp",node="0"}'] == 3.0
    assert s['p2ptrain_step_seconds_sum{algorithm="sgp",node="0"}'] == pytest.approx(20.32)
    assert s['p2ptrain_step_seconds_bucket{algorithm="sgp",le="0.025",node="0"}'] == 1.0
    assert s['p2ptrain_step_seconds_bucket{algorithm="sgp",le="0.25",node="0"}'] == 1.0
    assert s['p2ptrain_step_seconds_bucket{algorithm="sgp",le="0.5",node="0"}'] == 2.0
    assert s['p2ptrain_step_seconds_bucket{algorithm="sgp",le="10.0",node="0"}'] == 2.0
    assert s['p2ptrain_step_seconds_bucket{algorithm="sgp",le="+Inf",node="0"}'] == 3.0
    assert s['p2ptrain_loss{algorithm="sgp",node="0"}'] == 1.25
    assert s['p2ptrain_ps_weight{node="0"}'] == 0.375
    assert s['p2ptrain_step{node="0"}'] == 3.0
    # no series for peers / reasons that never happened
    assert 'p2ptrain_received_bytes_total{node="0",peer="2"}' not in s
    assert not any("reason=\"duplicate\"" in name for name in s)
    # plain running totals
    assert metrics.bytes_sent_total == 205 and metrics.bytes_received_total == 4000


def test_histogram_buckets_are_the_declared_ones(served):
    metrics, port = served
    metrics.on_step(0, 0.001, 1.0)  # exactly on the first boundary: le is inclusive
    s = scrape(port)
    buckets = [name for name in s if name.startswith("p2ptrain_step_seconds_bucket")]
    assert len(buckets) == len(STEP_SECONDS_BUCKETS) + 1
    assert s['p2ptrain_step_seconds_bucket{algorithm="sgp",le="0.001",node="0"}'] == 1.0


def test_scrape_reflects_later_changes(served):
    metrics, port = served
    metrics.set_ps_weight(1.0)
    assert scrape(port)['p2ptrain_ps_weight{node="0"}'] == 1.0
    metrics.set_ps_weight(0.5)
    metrics.on_sent(3, 10)
    s = scrape(port)
    assert s['p2ptrain_ps_weight{node="0"}'] == 0.5
    assert s['p2ptrain_sent_bytes_total{node="0",peer="3"}'] == 10.0


def test_rpc_calls_are_counted_by_method(served):
    """What membership costs: each gRPC call the node makes, by method, with its request bytes."""
    metrics, port = served
    metrics.on_rpc("Hello", 120)
    metrics.on_rpc("Hello", 80)
    metrics.on_rpc("Settle", 9)
    s = scrape(port)
    assert s['p2ptrain_rpc_calls_total{method="Hello",node="0"}'] == 2.0
    assert s['p2ptrain_rpc_bytes_total{method="Hello",node="0"}'] == 200.0
    assert s['p2ptrain_rpc_calls_total{method="Settle",node="0"}'] == 1.0
    assert metrics.rpc_totals == {"Hello": [2, 200], "Settle": [1, 9]}


def test_two_nodes_in_one_process_do_not_share_series():
    a, b = NodeMetrics(0, "sgp"), NodeMetrics(1, "sgp")
    a.on_sent(1, 100)
    b.on_sent(0, 7)
    assert a.registry.get_sample_value("p2ptrain_sent_bytes_total", {"node": "0", "peer": "1"}) == 100
    assert a.registry.get_sample_value("p2ptrain_sent_bytes_total", {"node": "1", "peer": "0"}) is None
    assert b.registry.get_sample_value("p2ptrain_sent_bytes_total", {"node": "1", "peer": "0"}) == 7
    assert (a.bytes_sent_total, b.bytes_sent_total) == (100, 7)


# Where /metrics listens (NodeConfig.metrics_bind_host) -------------------------------------------
@pytest.mark.parametrize("settings, host", [
    ({}, "0.0.0.0"),                                              # gRPC on [::]:port: all interfaces
    ({"listen": "127.0.0.1:50051"}, "127.0.0.1"),
    ({"listen": "[::1]:50051"}, "::1"),
    ({"listen": "10.1.2.3:50051"}, "10.1.2.3"),                   # launch --netns
    ({"listen": "localhost:50051"}, "localhost"),
    ({"listen": "[::]:50051"}, "0.0.0.0"),
    ({"listen": "0.0.0.0:50051"}, "0.0.0.0"),
    ({"listen": "127.0.0.1:50051", "metrics_host": "0.0.0.0"}, "0.0.0.0"),
    ({"metrics_host": "[::1]"}, "::1"),
    ({"role": "ps", "listen": "127.0.0.1:50051"}, "127.0.0.1"),
    ({"role": "ps", "ps_address": "ps:50051"}, "0.0.0.0"),        # listens on [::]:50051
    ({"role": "worker", "ps_address": "127.0.0.1:1", "listen": "127.0.0.1:2"}, "0.0.0.0"),  # serves no gRPC
    ({"role": "worker", "ps_address": "127.0.0.1:1", "metrics_host": "127.0.0.1"}, "127.0.0.1"),
])
def test_metrics_bind_host(settings, host):
    from p2ptrain.settings import NodeConfig

    gem = {"algorithm": "gem"} if settings.get("role") in ("ps", "worker") else {}
    assert NodeConfig.from_sources(env={}, flags={**gem, **settings}).metrics_bind_host == host


def test_metrics_host_setting_from_every_source(tmp_path):
    from p2ptrain import cli
    from p2ptrain.settings import ConfigError, NodeConfig

    toml = tmp_path / "node.toml"
    toml.write_text('metrics_host = "127.0.0.1"\n')
    assert NodeConfig.from_sources(toml_path=toml, env={}).metrics_host == "127.0.0.1"
    from_env = NodeConfig.from_sources(env={"P2PTRAIN_METRICS_HOST": "::1"})
    assert from_env.metrics_bind_host == "::1"
    args = cli.build_parser().parse_args(["node", "--metrics-host", "0.0.0.0", "--listen", "127.0.0.1:5"])
    assert cli.config_from_args(args).metrics_bind_host == "0.0.0.0"
    assert from_env.fingerprint() == NodeConfig.from_sources(env={}).fingerprint()  # per process, not shared
    for bad in ("127.0.0.1:9100", "two words", "http://x"):
        with pytest.raises(ConfigError, match="metrics_host"):
            NodeConfig.from_sources(env={}, flags={"metrics_host": bad})


def _connects(host: str, port: int) -> bool:
    import socket

    try:
        socket.create_connection((host, port), timeout=2).close()
        return True
    except OSError:
        return False


def _other_local_address() -> str | None:
    """A non-loopback address of this machine (None when it has none)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: no packet is sent, it only picks a route
            address = probe.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") or address == "0.0.0.0" else address


@pytest.mark.parametrize("metrics_host, bound", [(None, "127.0.0.1"), ("0.0.0.0", "0.0.0.0")])
def test_node_serves_metrics_on_its_listen_host(metrics_host, bound):
    """A node listening on 127.0.0.1 serves /metrics there only (another local address, 127.0.0.2
    or the machine's own IP, is refused); --metrics-host 0.0.0.0 opens it again."""
    from launcher.ports import free_ports
    from p2ptrain.node import Node
    from p2ptrain.settings import NodeConfig

    config = NodeConfig.from_sources(env={}, flags={"listen": f"127.0.0.1:{free_ports(1)[0]}", "metrics_port": 0,
                                                    "metrics_host": metrics_host, "device": "cpu"})
    with Node(config) as node:
        port = node.metrics_port
        assert node.metrics_address == (bound, port)
        scrape(port)  # answers on 127.0.0.1 in both cases
        assert "# TYPE p2ptrain_sent_bytes_total counter" in scrape.text
        others = [a for a in ("127.0.0.2", _other_local_address()) if a]
        reachable = {address: _connects(address, port) for address in others}
    if bound == "0.0.0.0":
        if not reachable.get("127.0.0.2", True):
            pytest.skip("127.0.0.2 is not a local address here (not Linux)")
        assert all(reachable.values()), reachable
    else:
        assert not any(reachable.values()), reachable


@pytest.mark.parametrize("served", [True, False])
def test_the_model_projection_is_drawn_at_attach_and_only_for_a_served_endpoint(served):
    """The projection's random directions are drawn when the optimizer attaches, not in a timed
    step; a node that serves no /metrics computes no projection at all (nobody reads it)."""
    from launcher.ports import free_ports
    from p2ptrain.node import Node
    from p2ptrain.settings import NodeConfig
    from p2ptrain.train.optimizer import DecentralizedOptimizer

    flags = {"listen": f"127.0.0.1:{free_ports(1)[0]}", "device": "cpu", "log_every": 1}
    config = NodeConfig.from_sources(env={}, flags={**flags, **({"metrics_port": 0} if served else {})})

    def projection(node) -> list[float]:
        return [s.value for m in node.metrics.registry.collect() if m.name == "p2ptrain_model_projection"
                for s in m.samples]

    with Node(config) as node:
        model = torch.nn.Linear(3, 2)
        optimizer = DecentralizedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, node=node)
        at_attach = projection(node)
        model(torch.ones(1, 3)).sum().backward()
        optimizer.step()
        after_step = projection(node)
    assert len(at_attach) == (4 if served else 0)
    assert len(after_step) == len(at_attach) and (not served or after_step != at_attach)


def test_a_metrics_port_in_use_is_a_one_line_error_naming_it(served):
    _, port = served
    with pytest.raises(OSError) as caught:
        NodeMetrics(1, "sgp").serve(port, addr="127.0.0.1")
    message = str(caught.value)
    assert f"127.0.0.1:{port}" in message and "--metrics-port" in message and "\n" not in message
