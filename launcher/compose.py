"""docker-compose file of a p2ptrain cluster: N peer nodes, an optional parameter-server profile,
Prometheus scraping every process and a provisioned Grafana dashboard.

Containers reach each other by service name (node0:50051, ps:50051), so every container uses the
same peer and metrics ports; every process serves /metrics on all of its interfaces
(--metrics-host 0.0.0.0), since Prometheus scrapes it from its own container. Nodes and the
parameter server get a `healthcheck:` running `p2ptrain health` against their own gRPC port
(the standard health service, which needs no token; the TLS flags are passed on). The Prometheus config is
inlined (compose `configs.content`); the Grafana files under launcher/grafana/ are mounted by paths
relative to the compose file. With `pki` (a `p2ptrain pki` folder) each container mounts only its own
certificate and key (named for its service) and the CA certificate, never another's or the CA key.
"""
from __future__ import annotations

import os
from pathlib import Path

import yaml

from p2ptrain.algorithms import registry

from . import certificates, prometheus

REPO = Path(__file__).resolve().parent.parent   # the build context: Dockerfile, pyproject.toml
GRAFANA = Path(__file__).resolve().parent / "grafana"
DEFAULT_PORT = 50051
DEFAULT_METRICS_PORT = 9100
IMAGE = "p2ptrain:latest"
PROMETHEUS_IMAGE = "prom/prometheus:v2.55.1"
GRAFANA_IMAGE = "grafana/grafana:11.3.0"
RUNS = "/runs"                      # named volume `runs`: every process writes its files here
PS_PROFILE = "ps"
NODE_ENV = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HOME": "/tmp"}
# p2ptrain containers cannot gain privileges or capabilities, nor write outside `runs` and a /tmp
# tmpfs (also HOME: libraries' caches); the image's user is uid 1000.
LOCKED_DOWN = {"read_only": True, "tmpfs": ["/tmp"], "cap_drop": ["ALL"], "security_opt": ["no-new-privileges:true"]}
# Node flags naming host files or folders: mounted read-only at the same absolute path in every
# container, so the command is the same inside as outside (and validates here).
HOST_PATH_FLAGS = ("--config", "--data-dir", "--tls-cert", "--tls-key", "--tls-ca", "--auth-token-file")
TLS_FLAGS = ("--tls-cert", "--tls-key", "--tls-ca")
METRICS_HOST = "0.0.0.0"            # reachable from the Prometheus container, whatever a mounted TOML says
# `p2ptrain health` imports torch (about 2 s of CPU): checks are rare and slow ones are tolerated.
HEALTHCHECK_TIMING = {"interval": "30s", "timeout": "20s", "retries": 3, "start_period": "120s"}


def compose_spec(nodes: int, node_args: list[str] = (), *, ps: bool = False, port: int = DEFAULT_PORT,
                 metrics_port: int = DEFAULT_METRICS_PORT, base_dir: str | Path = ".", image: str = IMAGE,
                 scrape_interval: str = "5s", pki: str | Path | None = None) -> dict:
    """The compose document. `node_args` (flag, value pairs as `p2ptrain node` takes them) go to
    every training process. With a parameter-server algorithm (`--algorithm gem`) in node_args the
    cluster is the parameter server plus `nodes` workers (like `p2ptrain launch`); otherwise `nodes`
    peers, and `ps=True` adds the server and workers as the `ps` profile (`docker compose --profile
    ps up`). `pki`: mutual TLS with a certificate per process from that `p2ptrain pki` folder
    (issued there when missing, for the service names), each mounted into its own container only."""
    if nodes < 1:
        raise ValueError(f"nodes must be >= 1, got {nodes}")
    for name, value in (("port", port), ("metrics port", metrics_port)):
        if not 0 < value < 65536:
            raise ValueError(f"{name} must be within 1..65535, got {value}")
    if port == metrics_port:
        raise ValueError(f"the peer port and the metrics port must differ (both {port})")
    if pki and (given := [flag for flag in TLS_FLAGS if _flag_value([str(a) for a in node_args], flag)]):
        raise ValueError(f"--pki gives every container its own certificate, key and CA: drop {' '.join(given)}")
    node_args, mounts = _host_paths(node_args)
    server = registry.runs_parameter_server(_flag_value(node_args, "--algorithm"))
    own = _own_certificates(pki, nodes, peers=not server, ps=server or ps,
                            server_name=_flag_value(node_args, "--tls-server-name")) if pki else {}
    base = _build(base_dir, image)
    volumes = [f"runs:{RUNS}", *mounts]
    services: dict[str, dict] = {}
    targets: dict[str, str] = {}
    if not server:
        peers = ",".join(f"node{i}:{port}" for i in range(nodes))
        for rank in range(nodes):
            services[f"node{rank}"] = {
                **base,
                "command": _Command(["node", "--rank", str(rank), "--world-size", str(nodes), "--peers", peers,
                            "--listen", f"0.0.0.0:{port}", "--metrics-port", str(metrics_port),
                            "--metrics-host", METRICS_HOST, "--out", RUNS, *node_args,
                            *own.get(rank, ((), ()))[0]]),
                "environment": dict(NODE_ENV),
                "volumes": [*volumes, *own.get(rank, ((), ()))[1]],
                "restart": "on-failure",   # a restarted node rejoins the cluster
                "healthcheck": healthcheck(f"node{rank}", port, [*node_args, *own.get(rank, ((), ()))[0]]),
            }
            targets[f"node{rank}"] = f"node{rank}:{metrics_port}"
    if server or ps:
        profile = {} if server else {"profiles": [PS_PROFILE]}
        out = RUNS if server else f"{RUNS}/ps"   # the profile's node{rank}.* files must not mix with the peers'
        algorithm = _flag_value(node_args, "--algorithm") if server else registry.algorithm_for_role("worker")
        server_args = [*_without(node_args, "--algorithm"), "--algorithm", algorithm]
        ps_tls, ps_mounts = own.get("ps", ((), ()))
        services["ps"] = {
            **base, **profile,
            "command": _Command(["ps", "--world-size", str(nodes), "--listen", f"0.0.0.0:{port}",
                                 "--metrics-port", str(metrics_port), "--metrics-host", METRICS_HOST,
                                 "--out", out, *server_args, *ps_tls]),
            "environment": dict(NODE_ENV),
            "volumes": [*volumes, *ps_mounts],
            "restart": "no",               # a restarted server would start again from θ_0
            "healthcheck": healthcheck("ps", port, [*server_args, *ps_tls]),
        }
        targets["ps"] = f"ps:{metrics_port}"
        for rank in range(nodes):
            services[f"worker{rank}"] = {
                **base, **profile,
                "command": _Command(["node", "--role", "worker", "--rank", str(rank), "--world-size", str(nodes),
                                     "--ps-address", f"ps:{port}", "--metrics-port", str(metrics_port),
                                     "--metrics-host", METRICS_HOST, "--out", out, *server_args,
                                     *own.get(rank, ((), ()))[0]]),
                "environment": dict(NODE_ENV),
                "volumes": [*volumes, *own.get(rank, ((), ()))[1]],
                "depends_on": ["ps"],
                "restart": "on-failure",
            }
            targets[f"worker{rank}"] = f"worker{rank}:{metrics_port}"
    services["prometheus"] = {
        "image": PROMETHEUS_IMAGE,
        "configs": [{"source": "prometheus", "target": "/etc/prometheus/prometheus.yml"}],
        "ports": ["9090:9090"],
    }
    services["grafana"] = {
        "image": GRAFANA_IMAGE,
        "environment": {
            "GF_AUTH_ANONYMOUS_ENABLED": "true",
            "GF_AUTH_ANONYMOUS_ORG_ROLE": "Viewer",
            "GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH": "/var/lib/grafana/dashboards/p2ptrain.json",
        },
        "volumes": [f"{_relative(GRAFANA / 'provisioning', base_dir)}:/etc/grafana/provisioning:ro",
                    f"{_relative(GRAFANA / 'dashboards', base_dir)}:/var/lib/grafana/dashboards:ro"],
        "ports": ["3000:3000"],
        "depends_on": ["prometheus"],
    }
    scrape = prometheus.scrape_config(targets, interval=scrape_interval)
    return {
        "name": "p2ptrain",
        "services": services,
        "configs": {"prometheus": {"content": _Literal(prometheus.dump(scrape))}},
        "volumes": {"runs": {}},
    }


def healthcheck(service: str, port: int, node_args: list[str]) -> dict:
    """A compose `healthcheck:` asking the service's own gRPC server (127.0.0.1:port inside its
    container) through `p2ptrain health`. With TLS it trusts the same CA, offers the same
    certificate (for mutual TLS) and expects the service name in the server certificate, as the
    peers do, unless --tls-server-name says otherwise."""
    test = ["CMD", "p2ptrain", "health", f"127.0.0.1:{port}"]
    tls = {flag: _flag_value(node_args, flag) for flag in ("--tls-ca", "--tls-cert", "--tls-key",
                                                           "--tls-server-name")}
    if tls["--tls-ca"] or tls["--tls-cert"]:
        tls["--tls-server-name"] = tls["--tls-server-name"] or service
        test += [arg for flag, value in tls.items() if value for arg in (flag, value)]
    return {"test": _Command(test), **HEALTHCHECK_TIMING}


def _own_certificates(pki: str | Path, nodes: int, *, peers: bool, ps: bool, server_name: str | None = None
                      ) -> dict[int | str, tuple[list, list]]:
    """Per rank (and "ps"): the TLS flags of mutual TLS with its own certificate, and the read-only
    mounts of its certificate, key and the CA certificate. A rank's certificate names every service
    that runs it (node<r>, and worker<r> in the ps profile): the names the others dial; and
    `server_name` (--tls-server-name), which peers and healthchecks then expect instead."""
    from p2ptrain.pki import ca_run_id

    directory = Path(pki).expanduser().resolve()
    run_id = ca_run_id(directory)
    ca = certificates.ca_certificate(directory)
    names: dict[int | str, list[str]] = {
        rank: [*([f"node{rank}"] if peers else []), *([f"worker{rank}"] if ps else [])] for rank in range(nodes)}
    if ps:
        names["ps"] = ["ps"]
    if server_name:
        names = {name: [*hosts, server_name] for name, hosts in names.items()}
    own = {}
    for name, hosts in names.items():
        cert, key = certificates.node_certificate(directory, name, hosts)
        flags = ["--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", str(ca), "--tls-require-client-cert",
                 "--run-id", run_id]
        own[name] = (flags, [f"{path}:{path}:ro" for path in (cert, key, ca)])
    return own


def render(spec: dict, command: str) -> str:
    """YAML text of a compose document, with a header saying how it was generated."""
    header = (f"Generated by `{command}`; do not edit by hand.\n"
              "Regenerate: add `--out FILE` to that command (tests/test_compose.py checks the checked-in\n"
              "docker-compose.yml against `p2ptrain compose --nodes 4 --ps`).\n"
              "Build: docker compose build   "
              "(CUDA: --build-arg BASE_IMAGE=... --build-arg TORCH_INDEX=..., see Dockerfile)\n"
              "Run:   docker compose up      (parameter server + GEM workers too: docker compose --profile ps up)\n"
              "Watch: Grafana http://localhost:3000, Prometheus http://localhost:9090")
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    return comment + yaml.dump(spec, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=4096)


def _build(base_dir: str | Path, image: str) -> dict:
    return {"build": {"context": _relative(REPO, base_dir)}, "image": image, **LOCKED_DOWN}


def _relative(path: Path, base_dir: str | Path) -> str:
    """`path` relative to the compose file's folder, spelled so compose reads it as a path
    (a bare name would be a named volume)."""
    rel = os.path.relpath(path, Path(base_dir).resolve())
    if rel == ".":
        return "."
    return rel if rel.startswith(("../", "/")) else f"./{rel}"


def _host_paths(node_args) -> tuple[list[str], list[str]]:
    """node_args with HOST_PATH_FLAGS values made absolute, and their read-only bind mounts."""
    argv = [str(a) for a in node_args]
    mounts = []
    for i, arg in enumerate(argv[:-1]):
        if arg in HOST_PATH_FLAGS:
            path = str(Path(argv[i + 1]).expanduser().resolve())
            argv[i + 1] = path
            if f"{path}:{path}:ro" not in mounts:
                mounts.append(f"{path}:{path}:ro")
    return argv, mounts


def _flag_value(argv: list[str], flag: str) -> str | None:
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def _without(argv: list[str], flag: str) -> list[str]:
    """argv without `flag VALUE` / `flag=VALUE`."""
    out, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
        elif arg == flag:
            skip = True
        elif not arg.startswith(flag + "="):
            out.append(arg)
    return out


class _Literal(str):
    """A multi-line string written as a YAML `|` block (the inlined Prometheus config stays readable)."""


class _Command(list):
    """A command line written on one line, as `[node, --rank, '0', ...]`."""


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data) -> bool:  # shared sub-dicts are written out, not as &id001 anchors
        return True


_Dumper.add_representer(_Literal, lambda dumper, value: dumper.represent_scalar("tag:yaml.org,2002:str", value,
                                                                                   style="|"))
_Dumper.add_representer(_Command, lambda dumper, value: dumper.represent_sequence("tag:yaml.org,2002:seq", value,
                                                                                     flow_style=True))
