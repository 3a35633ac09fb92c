"""An in-process cluster for algorithm tests: n real Transports (gRPC servers + clients on loopback),
one thread per node running `body(rank, comm)`.

Every byte still crosses real gRPC streams between real servers; only the processes are shared,
which keeps exact-math tests fast. Multi-process behaviour is covered by the launch tests.
"""
from __future__ import annotations

import concurrent.futures
from typing import Callable

from launcher.ports import free_ports
from p2ptrain.communicator import Communicator
from p2ptrain.metrics import NodeMetrics
from p2ptrain.transport import Transport, TransportOptions


def run_cluster(n: int, body: Callable[[int, Communicator], object], *, timeout: float = 120.0,
                options: TransportOptions | None = None,
                options_for: Callable[[int], TransportOptions] | None = None, metrics: bool = False,
                device: str = "cpu", host_of: Callable[[int], str] | None = None) -> list:
    """Run body on n nodes concurrently; returns the per-rank results, re-raising the first failure.
    With `metrics` every transport gets its own NodeMetrics (comm.transport.metrics); `device` is the
    communicators' training device (received tensors are staged onto it); `host_of(rank)`: the
    loopback address node `rank` listens on (default 127.0.0.1 for all: one host)."""
    ports = free_ports(n)
    peers = [f"{host_of(rank) if host_of else '127.0.0.1'}:{port}" for rank, port in enumerate(ports)]
    transports, comms = [], []
    try:
        for rank in range(n):
            opts = options_for(rank) if options_for else (options or TransportOptions(send_timeout=30.0))
            node_metrics = NodeMetrics(rank) if metrics else None
            transports.append(Transport(rank, n, peers, listen=peers[rank], options=opts,
                                        metrics=node_metrics).start())
        comms = [Communicator(t, device, peer_timeout=timeout) for t in transports]
        with concurrent.futures.ThreadPoolExecutor(n, thread_name_prefix="node") as pool:
            futures = [pool.submit(body, rank, comms[rank]) for rank in range(n)]
            results = []
            for future in futures:
                results.append(future.result(timeout=timeout + 30))
            return results
    finally:
        for transport in transports:
            transport.stop()
        for comm in comms:  # after the transports, as a node does: a background job still waiting fails
            comm.close()


def mass_in_flight_ledgers(ledgers: list[list[tuple]], at_steps) -> list[float]:
    """For each step k of `at_steps`: Σ_i w_i after step k (the ledgers' "w" entries) plus every
    share sent by step k that was neither mixed in nor re-absorbed by then (on the wire, or waiting
    in an inbox). Push-sum conserves it: n at every step."""
    totals = []
    for k in at_steps:
        total = 0.0
        for ledger in ledgers:
            total += next(w for event, step, w, *_ in ledger if event == "w" and step == k)
            for event, step, w, *_ in ledger:
                if step <= k and event == "send":
                    total += w
                elif step <= k and event in ("mix", "reabsorb"):
                    total -= w
        totals.append(total)
    return totals
