"""Ring all-reduce, AllReduce-SGD, Pipe-SGD and D-PSGD over real gRPC on loopback, each against a
single-process reference of the same math written here with plain tensors."""
from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest
import torch

from p2ptrain.algorithms.allreduce import AllReduceSGD
from p2ptrain.algorithms.base import Delivery
from p2ptrain.algorithms.collectives import (
    DIRECT_GATHER_MAX,
    CollectiveIncomplete,
    RingAllReduce,
    RingLayout,
    chunk_bounds,
    segment_bounds,
)
from p2ptrain.algorithms.dpsgd import DPSGD
from p2ptrain.algorithms.pipesgd import PipeSGD
from p2ptrain.topology.undirected import CompleteGraph, UndirectedRing
from tests.cluster import run_cluster

LR = 0.1


def vector(rank: int, numel: int, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * salt + rank)
    return torch.randn(numel, generator=g)


def gradient(rank: int, step: int, x: torch.Tensor) -> torch.Tensor:
    """A deterministic, node- and model-dependent stand-in for a stochastic gradient."""
    return 0.3 * (rank + 1) * x + vector(rank, x.numel(), salt=step + 1)


def test_segment_bounds_cover_everything_once():
    for numel, parts in [(10, 3), (3, 5), (0, 4), (17, 1)]:
        bounds = segment_bounds(numel, parts)
        assert len(bounds) == parts and bounds[0][0] == 0 and bounds[-1][1] == numel
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        sizes = [e - s for s, e in bounds]
        assert max(sizes) - min(sizes) <= 1


def test_a_ring_out_of_step_comes_back_in_step_and_the_node_ahead_never_gives_a_step_up():
    """Node 0 starts at step 10, nodes 1 and 2 at step 0 (a rejoiner admitted at a later switch
    than its peers had reached; seen in a 100-fault AllReduce run). The nodes behind give up steps
    whose predecessor is far past them at once, and node 0 waits for its predecessor while it comes
    closer, rather than give steps up at its own step numbers: before, each node failed every step
    at a different step number, for good. From step 10 on every call completes, exactly."""
    from p2ptrain.transport import TransportOptions

    numel, last = 12, 15

    def body(rank, comm):
        reduce = RingAllReduce(comm, numel)
        comm.ready()
        failed, done = [], {}
        for step in range(10 if rank == 0 else 0, last):
            comm.set_step(step)  # as a node's engine does: Acks and Hellos tell peers where it is
            try:
                done[step] = reduce(vector(rank, numel, salt=step), step=step, average=False).clone()
            except CollectiveIncomplete:
                failed.append(step)
        return failed, done

    results = run_cluster(3, body, options=TransportOptions(send_timeout=30.0, link_deadline=1.0))
    # (before: node 0 gave up every step from 10 on, and no call completed; on a busy machine a
    # laggard may still be slow enough to cost the node ahead one step)
    assert len(results[0][0]) <= 1, f"the node ahead gave steps {results[0][0]} up"
    for failed, done in results:
        assert set(range(11, last)) <= set(done) and not set(failed) & set(done)
        for step, value in done.items():
            torch.testing.assert_close(value, sum(vector(r, numel, salt=step) for r in range(3)), atol=1e-5, rtol=0)


@pytest.mark.timeout(150)
def test_a_predecessor_heard_at_a_view_switch_is_not_awaited_for_the_steps_before_it():
    """Node 0 is at the switch step S of a view every node holds and says so in a Hello; nodes 1
    and 2 are still at S-3 .. S-1 (nodes on either side of a refused eviction reach the switch
    that ends it at different steps; seen in the slow Pipe-SGD chaos run, where those behind
    waited 12 s at each of these steps). A member at a switch step runs no earlier round, so they
    give each one up at once (well within the 60 s link deadline, which the slack past the bounded
    delay alone would wait out), then the three meet at S and the round there completes exactly."""
    from p2ptrain.transport import TransportOptions

    numel, deadline = 12, 60.0
    behind_done = {1: threading.Event(), 2: threading.Event()}

    def body(rank, comm):
        reduce = RingAllReduce(comm, numel, elastic=True)
        comm.ready()
        if rank == 0:
            comm.membership.realign()  # the same members again, switching a margin ahead
        wait_for(lambda: comm.membership.latest.epoch == 1, 30, "view")
        switch = comm.membership.latest.switch_step
        given_up = []
        if rank == 0:
            comm.set_step(switch)
            assert comm.membership.probe(1)  # (a Hello: node 1 hears where node 0 is)
            for done in behind_done.values():  # its first segment of S would tell them too
                done.wait(4 * deadline)
        else:
            wait_for(lambda: comm.membership.peer_step(0) == switch or rank == 2, 30, "Hello from node 0")
            for step in range(switch - 3, switch):
                comm.set_step(step)
                started = time.monotonic()
                try:
                    reduce(vector(rank, numel, salt=step), step=step, average=False)
                except CollectiveIncomplete as exc:
                    given_up.append((step, time.monotonic() - started, str(exc)))
            comm.set_step(switch)
            behind_done[rank].set()
        return switch, given_up, reduce(vector(rank, numel, salt=99), step=switch, average=False).clone()

    results = run_cluster(3, body, options=TransportOptions(send_timeout=30.0, link_deadline=deadline))
    switch = results[0][0]
    assert switch >= 3 and all(r[0] == switch for r in results)
    for rank, (_, given_up, value) in enumerate(results):
        assert [step for step, *_ in given_up] == ([] if rank == 0 else list(range(switch - 3, switch)))
        assert all(seconds < deadline / 3 for _, seconds, _ in given_up), given_up
        torch.testing.assert_close(value, sum(vector(r, numel, salt=99) for r in range(3)), atol=1e-5, rtol=0)
    assert all(f"past the view switch at step {switch}" in reason for *_, reason in results[1][1]), results[1][1]


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {timeout}s"
        time.sleep(0.01)


@pytest.mark.parametrize("n,numel", [(2, 10), (3, 1001), (5, 3), (4, 64)])
def test_ring_allreduce_sum_and_mean_exact(n, numel):
    def body(rank, comm):
        reduce = RingAllReduce(comm, numel)
        comm.ready()
        a = reduce(vector(rank, numel), step=0, average=False)
        b = reduce(vector(rank, numel, salt=1), step=1, average=True)
        return a, b

    results = run_cluster(n, body)
    expected_sum = sum(vector(r, numel) for r in range(n))
    expected_mean = sum(vector(r, numel, salt=1) for r in range(n)) / n
    for a, b in results:
        torch.testing.assert_close(a, expected_sum, atol=1e-5, rtol=0)
        torch.testing.assert_close(b, expected_mean, atol=1e-5, rtol=0)


@pytest.mark.parametrize("codec,bound", [("trunc16", 2 ** -7), ("fp16", 2 ** -10), ("int8", 1 / 127)])
def test_ring_allreduce_compressed_hops_stay_within_error_bound_and_agree(codec, bound):
    n, numel = 4, 5000

    def body(rank, comm):
        reduce = RingAllReduce(comm, numel, codec=codec)
        comm.ready()
        return reduce(vector(rank, numel), step=0, average=True)

    results = run_cluster(n, body)
    exact = sum(vector(r, numel) for r in range(n)) / n
    for result in results:
        assert torch.equal(result, results[0])  # every node ends with the same bits
    # each of the n-1 reduce hops plus the final encoding loses at most `bound` of the running
    # magnitude; the inputs are O(1) normals, so partial sums stay below sum |x_j|
    scale = sum(vector(r, numel).abs() for r in range(n)).max() / n
    error = (results[0] - exact).abs().max()
    assert error <= n * bound * scale
    assert error > 0  # it really was compressed


def test_chunk_bounds_cut_a_segment_into_chunks_of_at_most_the_size():
    assert chunk_bounds(10, 20, 0) == [(10, 20)]
    assert chunk_bounds(10, 20, 4) == [(10, 13), (13, 16), (16, 20)]
    assert chunk_bounds(5, 5, 4) == [(5, 5)]  # an empty segment is still one (empty) message
    for start, end, size in [(0, 1001, 7), (3, 250, 64), (0, 9, 9)]:
        chunks = chunk_bounds(start, end, size)
        assert chunks[0][0] == start and chunks[-1][1] == end
        assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
        assert all(0 < b - a <= size for a, b in chunks)


@pytest.mark.parametrize("n,numel,chunk_bytes", [(2, 10, 8), (3, 1001, 400), (4, 4096, 1024), (5, 3, 4)])
@pytest.mark.parametrize("elastic", [False, True])
def test_pipelined_ring_is_bit_identical_to_the_unpipelined_ring(n, numel, chunk_bytes, elastic):
    """Chunks change when bytes move, never the order each element is summed in."""
    def body(rank, comm):
        plain = RingAllReduce(comm, numel, tag="p.", elastic=elastic)
        piped = RingAllReduce(comm, numel, tag="c.", elastic=elastic, chunk_bytes=chunk_bytes)
        comm.ready()
        out = []
        for step in range(2):  # twice: the reused send buffers and channels carry consecutive calls
            a = plain(vector(rank, numel, salt=step), step=step, average=step == 1)
            b = piped(vector(rank, numel, salt=step), step=step, average=step == 1)
            out.append((a, b))
        return out, piped.messages_per_call

    results = run_cluster(n, body)
    for out, messages in results:
        for a, b in out:
            assert torch.equal(a, b)
        chunks_per_segment = -(-(numel // n) // (chunk_bytes // 4)) if numel >= n else 1
        assert messages >= 2 * (n - 1) * max(1, chunks_per_segment)  # really cut into chunks
    expected = sum(vector(r, numel) for r in range(n))
    torch.testing.assert_close(results[0][0][0][1], expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("n,numel,chunk_bytes", [(2, 10, 0), (3, 1001, 400), (4, 4096, 0), (5, 3, 4), (4, 3000, 1000)])
@pytest.mark.parametrize("elastic", [False, True])
def test_direct_exchange_has_the_rings_bits_and_sends_each_segment_to_its_owner(n, numel, chunk_bytes, elastic):
    """A small ring's reduce-scatter sends every segment straight to its owner, who adds the
    contributions in the ring's order, and each owner sends its sum to everyone: the same bits as
    the m-1 hops of the ring, the same messages, two hops. (The sends are watched, not replaced.)"""
    def body(rank, comm):
        ring = RingAllReduce(comm, numel, tag="r.", elastic=elastic, chunk_bytes=chunk_bytes, direct_gather=False)
        direct = RingAllReduce(comm, numel, tag="d.", elastic=elastic, chunk_bytes=chunk_bytes)
        comm.ready()
        send, peers = comm.send, {"r.": set(), "d.": set()}

        def watched(peer, tensor, **header):
            peers[header["channel"][:2]].add(peer)
            return send(peer, tensor, **header)

        comm.send = watched
        out = []
        for step in range(2):
            a = ring(vector(rank, numel, salt=step), step=step, average=step == 1)
            b = direct(vector(rank, numel, salt=step), step=step, average=step == 1)
            out.append((a, b))
        return out, peers

    results = run_cluster(n, body)
    for rank, (out, peers) in enumerate(results):
        for a, b in out:
            assert torch.equal(a, b)
        assert peers["r."] == {(rank + 1) % n}
        assert peers["d."] == set(range(n)) - {rank}
    torch.testing.assert_close(results[0][0][0][1], sum(vector(r, numel) for r in range(n)), atol=1e-5, rtol=0)


@pytest.mark.parametrize("direct", [False, True])
def test_a_lossless_sum_leaves_a_zero_residual_on_every_node(direct):
    """Error feedback without a lossy codec: nothing is lost, whatever the residual held before."""
    n, numel = 3, 100

    def body(rank, comm):
        reduce = RingAllReduce(comm, numel, direct_gather=direct)
        comm.ready()
        residual = torch.ones(numel)
        return reduce(vector(rank, numel), step=0, average=False, residual=residual), residual

    for out, residual in run_cluster(n, body):
        assert torch.equal(residual, torch.zeros(numel))
        torch.testing.assert_close(out, sum(vector(r, numel) for r in range(n)), atol=1e-5, rtol=0)


def test_direct_exchange_is_for_small_rings_and_lossy_hops_stay_on_the_ring():
    """Past DIRECT_GATHER_MAX members every node would hold a connection to every other: the ring
    then takes its m-1 hops. A lossy codec keeps the ring's reduce-scatter (recompressed at every
    hop, seed 004) and sends only the owners' sums directly."""
    assert RingLayout(tuple(range(DIRECT_GATHER_MAX)), 0, 100, direct_gather=True).direct
    assert not RingLayout(tuple(range(DIRECT_GATHER_MAX + 1)), 0, 100, direct_gather=True).direct
    assert not RingLayout(tuple(range(4)), 0, 100, direct_gather=False).direct
    ring = RingLayout((3, 0, 2, 1), 2, 100, direct_gather=True)
    assert [ring.owner(s) for s in range(4)] == [1, 3, 0, 2]  # segment s is finished at position s - 1
    assert ring.owner(ring.owned()) == 2
    assert all(ring.ag_recv(ring.ag_round_at(2, s)) == s for s in range(4))


def test_pipelined_ring_with_int8_keeps_error_feedback_exact():
    """Per-chunk codec scales: the sum out plus every node's residual is the sum in."""
    n, numel = 4, 3000

    def body(rank, comm):
        reduce = RingAllReduce(comm, numel, codec="int8", chunk_bytes=1000)
        comm.ready()
        residual = torch.zeros(numel)
        return reduce(vector(rank, numel), step=0, average=False, residual=residual), residual

    results = run_cluster(n, body)
    exact = sum(vector(r, numel) for r in range(n))
    for out, _ in results:
        assert torch.equal(out, results[0][0])
    total = results[0][0] + sum(residual for _, residual in results)
    torch.testing.assert_close(total, exact, atol=1e-4, rtol=0)
    assert (results[0][0] - exact).abs().max() > 0


def test_ring_allreduce_rejects_wrong_size():
    def body(rank, comm):
        reduce = RingAllReduce(comm, 8)
        comm.ready()
        with pytest.raises(ValueError, match="declared for 8"):
            reduce(torch.zeros(9), step=0)
        return True

    assert run_cluster(2, body) == [True, True]


@pytest.mark.parametrize("chunk_bytes", [0, 400])
def test_ring_sends_straight_from_the_tensor_and_builds_sums_in_out_when_given(chunk_bytes):
    """Zero-copy: every uncompressed payload is a view of the tensor being reduced (in place) or of
    `out` and the input (with out=), never a send buffer; with out= the input is left as it was,
    and both give the same bits."""
    n, numel = 3, 3001

    def body(rank, comm):
        ring = RingAllReduce(comm, numel, chunk_bytes=chunk_bytes)
        comm.ready()
        storages, send = [], comm.send

        def spy(peer, tensor, **header):
            storages.append(tensor.untyped_storage().data_ptr())
            return send(peer, tensor, **header)

        comm.send = spy
        x, y, out = vector(rank, numel), vector(rank, numel), torch.empty(numel)
        in_place = ring(x, 0, average=False)
        in_place_sends, storages[:] = list(storages), []
        returned = ring(y, 1, average=False, out=out)
        assert in_place is x and returned is out
        assert torch.equal(y, vector(rank, numel))  # only read
        assert set(in_place_sends) == {x.untyped_storage().data_ptr()}
        assert set(storages) == {y.untyped_storage().data_ptr(), out.untyped_storage().data_ptr()}
        assert len(in_place_sends) == len(storages) >= 2 * (n - 1)
        return in_place, out

    results = run_cluster(n, body)
    expected = sum(vector(r, numel) for r in range(n))
    for in_place, out in results:
        assert torch.equal(in_place, out) and torch.equal(in_place, results[0][0])
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)


class _AllAlive:
    def all_alive(self):
        return True

    def dead(self):
        return frozenset()

    def asking_for_state(self):
        return frozenset()

    def peer_step(self, peer, heard_since=None):
        return None  # never heard from: the silent neighbour of _LateAcks

    def sent_step(self, peer, kind):
        return None


class _LateAcks:
    """A Comm on a 2-ring whose neighbour never sends a segment (every gather comes back empty) and
    acknowledges each message only when the test says so."""

    rank, world_size, link_deadline = 0, 2, 0.05
    membership = _AllAlive()

    def __init__(self):
        self.sent: list[tuple[torch.Tensor, torch.Tensor, concurrent.futures.Future]] = []

    def expect(self, *args, **kwargs):
        pass

    def make_room(self, peer, window):
        return True

    def take(self, kind, max_step, *, channel=""):
        return []

    def gather(self, kind, step, senders, *, channel="", deadline=None, abandon=None, laggards=False):
        return {}

    def send(self, peer, tensor, **header):
        future = concurrent.futures.Future()
        self.sent.append((tensor, tensor.clone(), future))
        return future

    def acknowledge_later(self, seconds: float) -> threading.Thread:
        def acknowledge():
            while not self.sent:
                time.sleep(0.01)
            time.sleep(seconds)
            for tensor, as_sent, future in self.sent:
                assert torch.equal(tensor, as_sent)  # the memory it was sent from did not change meanwhile
                future.set_result(Delivery(True))
        thread = threading.Thread(target=acknowledge)
        thread.start()
        return thread


@pytest.mark.parametrize("mode", ["restore", "out"])
def test_a_failed_call_fences_its_sends_before_anything_is_restored(mode):
    """The payloads are the tensor itself, so a call that fails returns only once each send has
    settled (no copy was taken for them), and only then restores the input."""
    comm = _LateAcks()
    ring = RingAllReduce(comm, 8)
    x = torch.arange(8.0)
    out = torch.zeros(8) if mode == "out" else None
    acknowledging = comm.acknowledge_later(0.3)
    with pytest.raises(CollectiveIncomplete, match="missed the link deadline"):
        ring(x, 0, out=out)
    assert comm.sent and all(future.done() for _, _, future in comm.sent)
    acknowledging.join()
    assert comm.sent[0][0].data_ptr() == x.data_ptr()  # the first segment went straight from the input
    assert torch.equal(x, torch.arange(8.0))


def test_out_on_a_ring_of_one_is_a_copy_of_the_input():
    def body(rank, comm):
        ring = RingAllReduce(comm, 5, elastic=True)
        comm.ready()
        x, out = vector(rank, 5), torch.zeros(5)
        assert ring(x, 0, members=[rank], out=out) is out
        return torch.equal(out, x)

    assert run_cluster(2, body) == [True, True]


def local_step(rank, step, x):
    return x - LR * gradient(rank, step, x)


@pytest.mark.parametrize("host_memory", [True, False])
@pytest.mark.parametrize("average", ["models", "gradients"])
def test_allreduce_sgd_matches_reference(average, host_memory):
    n, numel, steps = 4, 33, 5

    def body(rank, comm):
        algo = AllReduceSGD(comm, average=average, host_memory=host_memory)
        x = algo.setup(vector(0, numel, salt=99).clone())  # identical start
        history = []
        for step in range(steps):
            if average == "gradients":
                g = algo.reduce_gradients(step, gradient(rank, step, x))
                x = algo.after_step(step, x - LR * g)
            else:
                x = algo.after_step(step, local_step(rank, step, x))
            history.append(x.clone())
        agreed = algo.agree_at_end(steps, x)  # fault-free: the end agreement changes no bit
        assert agreed is x and algo.allreduce.end_averages == 0
        # one host: every step's round went through shared memory (host_allreduce.py), or none
        assert algo.stats().get("host_rounds", 0.0) == (steps if host_memory else 0)
        return history

    results = run_cluster(n, body)
    xs = [vector(0, numel, salt=99).clone() for _ in range(n)]
    for step in range(steps):
        if average == "gradients":
            g = sum(gradient(r, step, xs[r]) for r in range(n)) / n
            xs = [x - LR * g for x in xs]
        else:
            mean = sum(local_step(r, step, xs[r]) for r in range(n)) / n
            xs = [mean.clone() for _ in range(n)]
        for r in range(n):
            torch.testing.assert_close(results[r][step], xs[r], atol=1e-5, rtol=0)


@pytest.mark.parametrize("warmup", [0, 2])
def test_pipesgd_applies_one_step_stale_mean_gradient(warmup):
    n, numel, steps = 3, 21, 6

    def body(rank, comm):
        algo = PipeSGD(comm, warmup=warmup)
        x = algo.setup(vector(0, numel, salt=7).clone())
        history = []
        for step in range(steps):
            g = algo.reduce_gradients(step, gradient(rank, step, x))
            if g is not None:
                x = x - LR * g
            x = algo.after_step(step, x)
            history.append(x.clone())
        algo.finish()
        return history

    results = run_cluster(n, body)
    w = vector(0, numel, salt=7).clone()
    g_sum = {}
    for step in range(steps):
        g_sum[step] = sum(gradient(r, step, w) for r in range(n)) / n
        if step < warmup:
            w = w - LR * g_sum[step]
        elif step > warmup:
            w = w - LR * g_sum[step - 1]  # one iteration stale
        for r in range(n):
            torch.testing.assert_close(results[r][step], w, atol=1e-5, rtol=0)


def test_pipesgd_with_int8_stays_close_to_exact():
    n, numel, steps = 3, 40, 4

    def run(codec):
        def body(rank, comm):
            algo = PipeSGD(comm, codec=codec)
            x = algo.setup(torch.ones(numel))
            for step in range(steps):
                g = algo.reduce_gradients(step, gradient(rank, step, x))
                x = algo.after_step(step, x if g is None else x - LR * g)
            algo.finish()
            return x
        return run_cluster(n, body)

    exact, quantized = run("none"), run("int8")
    assert all(torch.equal(q, quantized[0]) for q in quantized)
    assert 0 < (exact[0] - quantized[0]).abs().max() < 0.05


@pytest.mark.parametrize("graph_cls,n", [(UndirectedRing, 5), (UndirectedRing, 2), (CompleteGraph, 4)])
def test_dpsgd_matches_metropolis_reference(graph_cls, n):
    numel, steps = 17, 5
    graph = graph_cls(n)
    W = torch.tensor(graph.metropolis_matrix(), dtype=torch.float64)
    assert torch.allclose(W, W.T) and torch.allclose(W.sum(0), torch.ones(n, dtype=torch.float64))

    def body(rank, comm):
        algo = DPSGD(comm, graph)
        x = algo.setup(vector(rank, numel))
        history = []
        for step in range(steps):
            x = algo.after_step(step, local_step(rank, step, x))
            history.append(x.clone())
        algo.finish()
        return history

    results = run_cluster(n, body)
    X = torch.stack([vector(r, numel) for r in range(n)]).double()
    for step in range(steps):
        grads = torch.stack([gradient(r, step, X[r].float()) for r in range(n)]).double()
        X = W @ X - LR * grads  # x^{t+1} = Σ_j W_ij x_j^t - γ ∇f_i(x_i^t)
        for r in range(n):
            torch.testing.assert_close(results[r][step].double(), X[r], atol=1e-5, rtol=0)


def test_dpsgd_refuses_a_directed_topology():
    from p2ptrain.topology import ExponentialGraph

    class FakeComm:
        rank, world_size = 0, 4

    with pytest.raises(ValueError, match="undirected"):
        DPSGD(FakeComm(), ExponentialGraph(4))
