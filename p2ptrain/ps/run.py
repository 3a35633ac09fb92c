"""`p2ptrain ps`: serve θ_0 to the workers of a GEM cluster until they are done, and write the run
folder's files like every role does (p2ptrain.train.progress): ps.progress.jsonl, ps.json and
ps.snapshots.pt. A role beside the node: it never imports p2ptrain.node.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from p2ptrain.addresses import join_address, split_address
from p2ptrain.metrics import PsMetrics
from p2ptrain.ps.server import ParameterServer, ps_fingerprint
from p2ptrain.train.data import build_dataset
from p2ptrain.train.evaluate import evaluate
from p2ptrain.train.progress import ProgressWriter, finite_or_none, write_summary
from p2ptrain.train.setup import initial_model
from p2ptrain.train.state import ModelState
from p2ptrain.transport.security import security_from_settings

log = logging.getLogger(__name__)


def ps_listen_address(config) -> str:
    """--listen, else all interfaces on the port of --ps-address."""
    if config.listen:
        return config.listen
    if config.ps_address:
        return join_address("::", split_address(config.ps_address)[1])
    raise ValueError("the parameter server needs --listen or --ps-address")


def run_ps(config) -> dict:
    """Serve θ_0 (the model that `model`, `hidden`, `dataset` and `seed` define, so every worker
    builds the same architecture) to `world_size` workers until all of them said Done or nothing
    happened for `peer_timeout` seconds. Writes OUT/ps.progress.jsonl (about once a second),
    OUT/ps.json (commits, staleness histogram, final θ's test loss / accuracy) and
    OUT/ps.snapshots.pt (θ every log_every × world_size versions); returns the summary."""
    torch.set_num_threads(config.threads)
    out = Path(config.out) if config.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    progress = ProgressWriter(out, "ps", role="ps")
    started = time.time()
    metrics_server = None
    try:
        model = initial_model(config)
        flat = ModelState(model, buffers=False)  # θ is the parameters alone
        metrics = PsMetrics()
        metrics_port = None
        if config.metrics_port is not None:
            metrics_server, _ = metrics.serve(config.metrics_port, addr=config.metrics_bind_host)
            metrics_port = metrics_server.server_port
        server = ParameterServer(flat.vector(), config.world_size, listen=ps_listen_address(config),
                                 chunk_bytes=config.chunk_bytes, fingerprint=ps_fingerprint(config),
                                 metrics=metrics, snapshot_every=config.log_every * config.world_size,
                                 security=security_from_settings(config.security))
        with server:
            log.info("parameter server: %d parameters, %d workers, listening on port %d", flat.numel,
                     config.world_size, server.port)
            progress.write(event="listening", time=time.time(), port=server.port, numel=flat.numel,
                           workers=config.world_size)
            complete = _serve_until_done(server, config, progress)
            version, theta = server.theta()
            stats = server.stats()
            snapshots = server.snapshots()
        flat.load(theta)
        test = build_dataset(config.dataset, config.data_dir, seed=config.seed, num_train=config.num_train,
                             num_test=config.num_test).test
        test_loss, test_accuracy = evaluate(model, torch.utils.data.DataLoader(test, batch_size=512),
                                             loss_fn=F.nll_loss)  # the built-in models output log-probabilities
        wall = time.time() - started
        summary = {
            "role": "ps", **stats, "complete": complete, "numel": flat.numel, "test_loss": test_loss,
            "test_accuracy": test_accuracy, "wall_seconds": wall,
            "commits_per_second": stats["commits"] / wall if wall > 0 else None, "metrics_port": metrics_port,
            "port": server.port,
        }
        write_summary(out, "ps", summary, snapshots)
        progress.write(event="done" if complete else "incomplete", time=time.time(), version=version)
        return finite_or_none(summary)
    except BaseException as exc:
        progress.write(event="error", time=time.time(), message=f"{type(exc).__name__}: {exc}")
        raise
    finally:
        if metrics_server is not None:
            metrics_server.shutdown()
        progress.close()


def _serve_until_done(server: ParameterServer, config, progress: ProgressWriter) -> bool:
    """Write a progress line about once a second until every worker said Done (True), or nothing
    happened for peer_timeout seconds (False)."""
    last_time, last_commits = time.monotonic(), 0
    while True:
        if server.all_done.wait(1.0):
            return True
        stats = server.stats()
        now = time.monotonic()
        progress.write(time=time.time(), version=stats["version"], commits=stats["commits"],
                       commits_per_second=(stats["commits"] - last_commits) / max(now - last_time, 1e-9),
                       staleness=finite_or_none({"s": stats["recent_staleness"]})["s"],
                       workers_done=stats["workers_done"], pull_bytes=stats["pull_bytes"],
                       commit_bytes=stats["commit_bytes"])
        last_time, last_commits = now, stats["commits"]
        if now - server.state.last_activity > config.peer_timeout:
            log.warning("parameter server: nothing happened for %.0fs with %d of %d workers done; stopping",
                        config.peer_timeout, stats["workers_done"], config.world_size)
            return False


__all__ = ["ps_listen_address", "run_ps"]
