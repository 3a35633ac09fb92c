"""Prometheus scrape configuration for p2ptrain clusters (docker-compose and `p2ptrain launch`).

Every target is one process serving /metrics: a node, a parameter-server worker or the server.
Targets carry a `service` label (node0, worker3, ps) and a `node` label. `honor_labels` keeps the
`node` label the process exports itself (its rank), so the target's `node` label only fills in
series that have none: `up`, the scrape_* series and the parameter server's series (node="ps").
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable

import yaml

from p2ptrain.addresses import is_host_port, join_address

JOB = "p2ptrain"
CONFIG_NAME = "prometheus.yml"  # what `p2ptrain launch` writes into its run folder


def node_label(service: str) -> str:
    """The `node` label value a service's own metrics use: node3 / worker3 -> "3", ps -> "ps"."""
    match = re.fullmatch(r"(?:node|worker)(\d+)", service)
    return match.group(1) if match else service


def scrape_config(targets: dict[str, str], interval: str = "5s", job: str = JOB) -> dict:
    """Prometheus configuration scraping `targets` (service name -> host:port) every `interval`."""
    if not targets:
        raise ValueError("a scrape config needs at least one target")
    for service, address in targets.items():
        if not is_host_port(address):
            raise ValueError(f"metrics address {address!r} of {service} is not host:port")
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "scrape_configs": [{
            "job_name": job,
            "honor_labels": True,
            "static_configs": [{"targets": [address], "labels": {"service": service, "node": node_label(service)}}
                               for service, address in targets.items()],
        }],
    }


def dump(config: dict, header: str = "") -> str:
    """YAML text of a config (keys in the order given), with an optional comment header."""
    body = yaml.safe_dump(config, sort_keys=False, default_flow_style=False)
    comment = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
    return comment + body


def write_scrape_config(path: str | Path, targets: dict[str, str], interval: str = "5s") -> Path:
    """Write scrape_config(targets, interval) to `path`; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump(scrape_config(targets, interval),
                         header="Prometheus scrape config of a p2ptrain cluster, written by p2ptrain.\n"
                                f"Run: prometheus --config.file={path.name}"))
    return path


def metrics_targets(specs: Iterable, host: str = "127.0.0.1") -> dict[str, str]:
    """host:port of every process spec (launcher.local.NodeProcessSpec) started with --metrics-port,
    keyed by its service name (node{rank}, or the spec's own name such as ps)."""
    targets = {}
    for spec in specs:
        argv = list(spec.argv)
        if "--metrics-port" in argv:
            port = int(argv[argv.index("--metrics-port") + 1])
            targets[spec.name or f"node{spec.rank}"] = join_address(getattr(spec, "host", "") or host, port)
    return targets


def write_launch_config(out_dir: str | Path, specs: Iterable, host: str = "127.0.0.1",
                        interval: str = "1s") -> Path | None:
    """OUT/prometheus.yml for a local cluster (1 s: local runs are short); None without metrics."""
    targets = metrics_targets(specs, host)
    return write_scrape_config(Path(out_dir) / CONFIG_NAME, targets, interval) if targets else None
