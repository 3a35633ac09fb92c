"""The ring all-gather of sparse payloads (issue 26) over real gRPC on loopback (tests/cluster.py):
every member ends with the same bits, the rank-ordered sum of each member's own decode(encode(x));
each residual is the node's own loss; a node sends m-1 payloads; DiLoCo's sparse codecs go over it
and keep every anchor bit-identical; a member that never sends fails the call on the others."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from p2ptrain.algorithms.allgather import RingAllGather
from p2ptrain.algorithms.collectives import CollectiveIncomplete, RingAllReduce
from p2ptrain.algorithms.diloco import DiLoCo
from p2ptrain.algorithms.outer import OuterNesterov
from p2ptrain.compression import make_codec
from p2ptrain.settings import NodeConfig
from p2ptrain.transport import TransportOptions
from tests.cluster import run_cluster
from tests.test_allreduce import vector
from tests.test_diloco import NUMEL, inner, start, train

FRACTION = 0.05


def codec(name: str):
    return make_codec(name, topk_fraction=FRACTION)


def decoded(name: str, x: torch.Tensor) -> torch.Tensor:
    """decode(encode(x)): what a node's own payload says."""
    encoded = codec(name).encode(x)
    return codec(name).decode(encoded.payload, encoded.params, encoded.shape)


def rank_ordered_sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    total = tensors[0].clone()
    for tensor in tensors[1:]:
        total.add_(tensor)
    return total


@pytest.mark.parametrize("n", [3, 4])
@pytest.mark.parametrize("name", ["topk", "sparseloco", "dct-topk", "none"])
def test_every_member_ends_with_the_rank_ordered_sum_of_each_ones_own_payload(n, name):
    """Bit-identical means on every node, equal to Σ_r decode(encode(x_r)) / m added in rank order;
    each residual is exactly the node's own x - decode(encode(x)); each node sends m-1 payloads."""
    numel = 5000  # sparseloco: a 4096-entry chunk and a shorter one

    def body(rank, comm):
        gather = RingAllGather(comm, numel, codec=codec(name), tag="g.")
        comm.ready()
        residual = torch.full((numel,), float("nan"))  # overwritten everywhere
        before = comm.transport.metrics.bytes_sent_total
        mean = gather(vector(rank, numel), step=0, average=True, residual=residual)
        sent = comm.transport.metrics.bytes_sent_total - before
        total = gather(vector(rank, numel, salt=1), step=1, average=False)
        return mean, residual, sent, total, gather.payload_bytes

    results = run_cluster(n, body, metrics=True)
    own = [decoded(name, vector(r, numel)) for r in range(n)]
    expected_mean = rank_ordered_sum(own).div_(n)
    expected_total = rank_ordered_sum([decoded(name, vector(r, numel, salt=1)) for r in range(n)])
    payload = codec(name).payload_bytes(numel)
    assert name == "none" or payload < numel  # really sparse: fewer bytes than entries
    for rank, (mean, residual, sent, total, payload_bytes) in enumerate(results):
        assert torch.equal(mean, expected_mean) and torch.equal(total, expected_total)
        assert torch.equal(residual, vector(rank, numel) - own[rank])  # its own loss, nobody else's
        assert payload_bytes == payload and sent == (n - 1) * payload
    assert name == "none" or (results[0][1] != 0).any()


@pytest.mark.parametrize("name", ["topk", "sparseloco"])
def test_diloco_over_the_all_gather_matches_its_math_and_every_anchor_has_the_same_bits(name):
    """Per sync: e_i, Δ̂_i = encode/decode of (θ - θ_i + e_i) on node i alone, the outer step takes
    Σ_i Δ̂_i / m in rank order. Every node's anchor and model are the same bits after every sync."""
    n, H, steps = 3, 4, 16

    def body(rank, comm):
        algo = DiLoCo(comm, inner_steps=H, compression=name, topk_fraction=FRACTION)
        x, anchors = algo.setup(start()), []
        assert all(isinstance(exchange, RingAllGather) for exchange in algo.exchanges)
        for step in range(steps):
            x = algo.after_step(step, inner(rank, step, x))
            if algo.due(step) is not None:
                anchors.append((algo.anchor.clone(), x.clone(), algo.residual.clone()))
        algo.finish()
        return anchors, algo.stats()

    results = run_cluster(n, body)
    anchor, buffer, outer = start(), torch.zeros(NUMEL), OuterNesterov(0.7, 0.9)
    xs, residuals, sync = [start() for _ in range(n)], [torch.zeros(NUMEL) for _ in range(n)], 0
    for step in range(steps):
        xs = [inner(r, step, x) for r, x in enumerate(xs)]
        if (step + 1) % H:
            continue
        sent = [anchor - x + e for x, e in zip(xs, residuals)]
        own = [decoded(name, delta) for delta in sent]
        residuals = [delta - d for delta, d in zip(sent, own)]
        outer.step(anchor, rank_ordered_sum(own).div_(n), buffer)
        xs = [anchor.clone() for _ in range(n)]
        for rank in range(n):
            theirs, model, residual = results[rank][0][sync]
            assert torch.equal(theirs, results[0][0][sync][0]) and torch.equal(model, theirs)
            torch.testing.assert_close(theirs, anchor, atol=1e-6, rtol=0)
            torch.testing.assert_close(residual, residuals[rank], atol=1e-6, rtol=0)
        sync += 1
    assert sync == steps // H and all(r[1]["outer_steps"] == sync and r[1]["failed_syncs"] == 0 for r in results)
    assert (anchor - start()).abs().max() > 0.1  # it trained


def test_streaming_diloco_overlapping_the_all_gather_ends_with_the_same_model_everywhere():
    """F = 2 fragments, τ = 1: each fragment's all-gather runs on the communication worker during
    the next inner step; finish() leaves every node with the same model and anchor bits."""
    n, H, steps = 3, 4, 14

    def body(rank, comm):
        algo = DiLoCo(comm, inner_steps=H, fragments=2, outer_delay=1, compression="sparseloco",
                      topk_fraction=FRACTION)
        history, final = train(algo, rank, steps)
        return final, algo.anchor.clone(), algo.stats()

    results = run_cluster(n, body)
    syncs = DiLoCo(Solo(), inner_steps=H, fragments=2, outer_delay=1).fragment_syncs(steps)
    for final, anchor, stats in results:
        assert torch.equal(final, results[0][0]) and torch.equal(anchor, results[0][1])
        assert stats["outer_steps"] == syncs and stats["failed_syncs"] == 0
    assert (results[0][0] - start()).abs().max() > 0.1


def test_diloco_node_that_misses_a_sync_of_the_all_gather_catches_up_with_the_same_bits():
    """As over the ring (test_diloco): node 2 comes to the sync after step 9 too late, the others
    all-gather without it, it takes node 0's outer state at the next sync, and all end alike."""
    n, H, steps = 3, 5, 20

    def body(rank, comm):
        def pace(step):
            time.sleep(0.03)
            if rank == 2 and step == 8:
                time.sleep(1.5)

        algo = DiLoCo(comm, inner_steps=H, compression="topk", topk_fraction=FRACTION)
        history, final = train(algo, rank, steps, before_step=pace)
        return final, algo.anchor.clone(), algo.stats()

    results = run_cluster(n, body, options=TransportOptions(send_timeout=30.0, link_deadline=1.0,
                                                            probe_timeout=1.0))
    assert results[2][2]["caught_up"] == 1 and results[2][2]["failed_syncs"] == 1
    assert all(r[2]["failed_syncs"] == 0 for r in results[:2])
    assert all(torch.equal(r[0], results[0][0]) and torch.equal(r[1], results[0][1]) for r in results)


class Solo:
    """A one-node Comm: setup() declares nothing a peer would send."""

    rank, world_size, joined = 0, 1, None

    def expect(self, *args, **kwargs):
        pass

    def ready(self):
        pass


def test_sparse_exchange_option_picks_the_all_gather_for_sparse_codecs_only():
    def exchange(**kwargs):
        algo = DiLoCo(Solo(), inner_steps=4, **kwargs)
        algo.setup(torch.zeros(8))
        return type(algo.exchanges[0])

    assert exchange(compression="topk") is RingAllGather
    assert exchange(compression="dct-topk") is RingAllGather
    assert exchange(compression="sparseloco", sparse_exchange="ring") is RingAllReduce
    assert exchange(compression="int8") is RingAllReduce  # dense codecs keep the ring
    assert exchange() is RingAllReduce
    options = NodeConfig.from_sources(env={}, flags=dict(algorithm="diloco", inner_steps=4, compression="topk",
                                                         sparse_exchange="ring")).validate().algorithm_options
    assert options.sparse_exchange == "ring"
    with pytest.raises(Exception, match="sparse_exchange"):
        NodeConfig.from_sources(env={}, flags=dict(algorithm="diloco", inner_steps=4,
                                                   sparse_exchange="gossip")).validate()


def test_a_member_that_never_sends_fails_the_call_on_the_others_within_the_deadline():
    """Node 2 sends nothing at step 0: nodes 0 and 1 raise CollectiveIncomplete about a link deadline
    later, with their input and residual as they were; the next call, with everybody, is exact."""
    n, numel, deadline = 3, 2000, 1.0
    gave_up = [threading.Event() for _ in range(n - 1)]

    def body(rank, comm):
        gather = RingAllGather(comm, numel, codec=codec("topk"))
        comm.ready()
        x, residual = vector(rank, numel), torch.full((numel,), 0.5)
        waited = None
        if rank < n - 1:
            began = time.monotonic()
            with pytest.raises(CollectiveIncomplete, match="all-gather payload of node 2"):
                gather(x, step=0, average=True, residual=residual)
            waited = time.monotonic() - began
            assert torch.equal(x, vector(rank, numel)) and torch.equal(residual, torch.full((numel,), 0.5))
            gave_up[rank].set()
        else:
            assert all(event.wait(60) for event in gave_up)
        comm.set_step(1)
        return waited, gather(x, step=1, average=True, residual=residual), residual

    results = run_cluster(n, body, options=TransportOptions(send_timeout=30.0, link_deadline=deadline))
    own = [decoded("topk", vector(r, numel)) for r in range(n)]
    for rank, (waited, mean, residual) in enumerate(results):
        assert rank == n - 1 or 0.5 * deadline < waited < 5 * deadline, waited
        assert torch.equal(mean, rank_ordered_sum(own).div_(n))
        assert torch.equal(residual, vector(rank, numel) - own[rank])


def test_a_payload_forged_on_the_way_fails_the_call_where_it_arrives_and_restores_the_residual():
    """Node 1 forwards node 0's top-k payload with an index out of range: node 2 refuses to decode
    it (CollectiveIncomplete, its residual as it was) instead of failing the training."""
    n, numel = 3, 1000

    def body(rank, comm):
        gather = RingAllGather(comm, numel, codec=codec("topk"), tag="f.")
        comm.ready()
        send = comm.send

        def forge(peer, tensor, **header):
            if header.get("channel") == "f.ag3.0":
                tensor = tensor.clone()
                tensor[:4] = 255  # the first int32 index: -1
            return send(peer, tensor, **header)

        if rank == 1:
            comm.send = forge
        residual = torch.full((numel,), 0.25)
        try:
            gather(vector(rank, numel), step=0, residual=residual)
        except CollectiveIncomplete as exc:
            return str(exc), residual
        return None, residual

    results = run_cluster(n, body)
    assert [error is None for error, _ in results] == [True, True, False]
    assert "payload of node 0 cannot be decoded" in results[2][0]
    assert torch.equal(results[2][1], torch.full((numel,), 0.25))
