"""RelaySGD (seed 003 Alg. 2): the trees, the RelaySum mechanism, and the algorithm over real gRPC
against a single-process recursion of the same math for all nodes at once."""
from __future__ import annotations

import concurrent.futures
from types import SimpleNamespace

import pytest
import torch

from p2ptrain.algorithms import registry
from p2ptrain.algorithms.base import Delivery
from p2ptrain.algorithms.relaysgd import NORMALIZATIONS, RelaySGD, RelaySGDOptions, RelaySum
from p2ptrain.topology.trees import (
    TREE_NAMES,
    BinaryTree,
    Chain,
    DoubleBinaryTrees,
    MirroredBinaryTree,
    build_relay_trees,
    coordinate_slices,
)
from tests.cluster import run_cluster

DIM, STEPS, LR = 11, 8, 0.3  # odd DIM: the double trees' halves differ in size


# Topologies -------------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [Chain, BinaryTree, MirroredBinaryTree])
@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 8, 13])
def test_trees_are_symmetric_spanning_trees(make, n):
    tree = make(n)
    for i in range(n):
        nbrs = tree.neighbors(i)
        assert nbrs == sorted(set(nbrs)) and i not in nbrs
        assert all(i in tree.neighbors(j) for j in nbrs)
    assert len(tree.edges()) == n - 1
    assert min(tree.distances(0)) == 0 and -1 not in tree.distances(0)  # connected


def test_diameters():
    assert [Chain(n).diameter() for n in (1, 2, 5, 8)] == [0, 1, 4, 7]
    assert BinaryTree(7).diameter() == 4
    assert BinaryTree(8).diameter() == 5  # leaf 7 (depth 3) to leaf 6 (depth 2) through the root
    assert MirroredBinaryTree(8).diameter() == 5
    assert Chain(5).distances(0) == [0, 1, 2, 3, 4]
    assert BinaryTree(7).eccentricity(0) == 2


def test_binary_tree_and_its_mirror():
    a, b = BinaryTree(8), MirroredBinaryTree(8)
    assert a.root == 0 and a.parent(0) is None and a.children(0) == [1, 2] and a.children(3) == [7]
    assert b.root == 7 and b.parent(7) is None and b.children(7) == [5, 6] and b.children(4) == [0]
    for i in range(8):  # node i of B is node 7 - i of A
        assert b.neighbors(i) == sorted(7 - j for j in a.neighbors(7 - i))


@pytest.mark.parametrize("n", range(2, 17))
def test_double_binary_trees_are_complementary(n):
    a, b = DoubleBinaryTrees(n).trees
    interior_a = {i for i in range(n) if a.children(i)}
    interior_b = {i for i in range(n) if b.children(i)}
    assert not interior_a & interior_b  # no node relays for subtrees in both trees
    if n % 2 == 0:
        assert interior_a | interior_b == set(range(n))  # e.g. n=8: A {0,1,2,3}, B {4,5,6,7}
    else:
        assert set(range(n)) - (interior_a | interior_b) == {(n - 1) // 2}  # a leaf in both
    if n >= 3:
        assert set(a.edges()) != set(b.edges())


def test_coordinate_slices_and_relay_trees():
    assert coordinate_slices(11, 2) == [slice(0, 6), slice(6, 11)]
    assert coordinate_slices(4, 1) == [slice(0, 4)]
    assert DoubleBinaryTrees(5).slices(3) == [slice(0, 2), slice(2, 3)]
    assert [type(t) for t in build_relay_trees("double-binary-trees", 5)] == [BinaryTree, MirroredBinaryTree]
    assert [type(t) for t in build_relay_trees("chain", 5)] == [Chain]
    assert [type(t) for t in build_relay_trees("binary-tree", 5)] == [BinaryTree]


def test_unknown_tree_name_lists_choices():
    comm = SimpleNamespace(rank=0, world_size=4)
    with pytest.raises(ValueError, match="choose from chain, binary-tree, double-binary-trees"):
        RelaySGD(comm, "ring")
    assert TREE_NAMES == ("chain", "binary-tree", "double-binary-trees")


# Single-process reference -----------------------------------------------------------------------
def initial(rank: int) -> torch.Tensor:
    return torch.randn(DIM, generator=torch.Generator().manual_seed(100 + rank), dtype=torch.float64)


DIRECTION = torch.randn(DIM, generator=torch.Generator().manual_seed(7), dtype=torch.float64)


def local_step(rank: int, x: torch.Tensor, lr: float) -> torch.Tensor:
    """x^{t+1/2} = x^t - γ (x^t - (rank+1) a): a deterministic gradient that differs by node."""
    return x - lr * (x - (rank + 1) * DIRECTION.to(x.dtype))


def reference(trees, n: int, steps: int, lr: float, relay_fixed: torch.Tensor | None = None,
              normalization: str = "counters", x0: torch.Tensor | None = None, local=local_step):
    """Alg. 2 for all nodes at once in float64: per step the models X^{t+1} [n, DIM] and the n̄ of
    every tree. With `relay_fixed` node i relays that fixed vector instead of x^{t+1/2} (RelaySum
    alone) and the returned 'models' are (v_i + Σ_j m_{j→i}) / n̄_i. With normalization
    "world-size" node i divides by n instead and counts each of the n - n̄_i models it lacks as its
    own x_i^{(t)}. `x0`: the initial models [n, DIM] (default: initial(rank) for each rank);
    `local(rank, x, lr)`: the local step (default local_step)."""
    x = torch.stack([initial(r) for r in range(n)]) if x0 is None else x0.clone()
    slices = coordinate_slices(DIM, len(trees))
    last = [{} for _ in trees]  # per tree: (k, i) -> (m_{k→i}^{(t-1)}, c_{k→i}^{(t-1)})
    xs, nbars = [], []
    for _ in range(steps):
        half = relay_fixed if relay_fixed is not None else torch.stack(
            [local(r, x[r], lr) for r in range(n)])
        new, nbar = torch.empty_like(half), []
        for tree, sl, prev in zip(trees, slices, last):
            sent = {}
            for i in range(n):
                for j in tree.neighbors(i):
                    others = [prev.get((k, i), (0.0, 0.0)) for k in tree.neighbors(i) if k != j]
                    sent[(i, j)] = (half[i, sl] + sum(m for m, _ in others), 1.0 + sum(c for _, c in others))
            prev.clear()
            prev.update(sent)
            nbar.append([1.0 + sum(sent[(j, i)][1] for j in tree.neighbors(i)) for i in range(n)])
            for i in range(n):
                received = half[i, sl] + sum(sent[(j, i)][0] for j in tree.neighbors(i))
                if normalization == "world-size":
                    new[i, sl] = (received + (n - nbar[-1][i]) * x[i, sl]) / n
                else:
                    new[i, sl] = received / nbar[-1][i]
        x = new
        xs.append(x.clone())
        nbars.append(nbar)
    return torch.stack(xs), torch.tensor(nbars, dtype=torch.float64)  # [steps, n, DIM], [steps, trees, n]


def consensus_distance(x: torch.Tensor) -> float:
    return float((x - x.mean(0)).norm())


# RelaySGD over real gRPC ------------------------------------------------------------------------
def run_relaysgd(name: str, n: int, steps: int, lr: float, normalization: str = "counters"):
    def body(rank, comm):
        alg = RelaySGD(comm, name, normalization=normalization)
        x = alg.setup(initial(rank).float())
        trace, relay_n = [], []
        for step in range(steps):
            x = alg.after_step(step, local_step(rank, x, lr))
            trace.append(x.clone())
            relay_n.append(alg.stats()["relay_n"])
        alg.finish()
        return torch.stack(trace), relay_n

    results = run_cluster(n, body, timeout=30)
    got = torch.stack([r[0] for r in results], dim=1).double()  # [steps, n, DIM]
    relay_n = torch.tensor([r[1] for r in results], dtype=torch.float64).T  # [steps, n]
    return got, relay_n


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", TREE_NAMES)
@pytest.mark.parametrize("n", [5, 8])
def test_relaysgd_matches_reference(name, n):
    trees = build_relay_trees(name, n)
    got, relay_n = run_relaysgd(name, n, STEPS, LR)
    ref, ref_nbar = reference(trees, n, STEPS, LR)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5, msg=f"{name}, n={n}: models")
    torch.testing.assert_close(relay_n, ref_nbar.mean(1), rtol=0, atol=0, msg=f"{name}: n̄")
    # n̄_i counts the models heard of: 1 + #nodes within t+1 hops, all n after the diameter
    for tree_k, tree in enumerate(trees):
        for i in range(n):
            dist = tree.distances(i)
            assert ref_nbar[:, tree_k, i].tolist() == [sum(d <= t + 1 for d in dist) for t in range(STEPS)]
    assert relay_n[-1].tolist() == [float(n)] * n


@pytest.mark.timeout(60)
def test_relaysgd_models_reach_consensus_without_gradients():
    """Alg. 2 relays the re-averaged model, so x is NOT the exact average after `diameter` steps
    (unlike RelaySum on fixed inputs), but the consensus distance shrinks towards 0."""
    n, steps, name = 8, 30, "double-binary-trees"
    trees = build_relay_trees(name, n)
    got, _ = run_relaysgd(name, n, steps, lr=0.0)
    ref, _ = reference(trees, n, steps, lr=0.0)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    x0 = torch.stack([initial(r) for r in range(n)])
    diameter = max(t.diameter() for t in trees)
    assert float((ref[diameter - 1] - x0.mean(0)).abs().max()) > 1e-2  # not exact in finite time
    start, end = consensus_distance(x0), consensus_distance(ref[-1])
    assert consensus_distance(ref[diameter - 1]) < 0.5 * start
    assert end < 0.05 * start


# World-size normalization ----------------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("name,n", [("chain", 5), ("binary-tree", 8), ("double-binary-trees", 8)])
def test_relaysgd_world_size_matches_reference(name, n):
    """--relay-normalization world-size over real gRPC against the plain-tensor recursion
    x_i^{t+1} = (x_i^{t+1/2} + Σ_j m_{j→i} + (n - n̄_i) x_i^t) / n, with node-dependent gradients."""
    trees = build_relay_trees(name, n)
    got, relay_n = run_relaysgd(name, n, STEPS, LR, normalization="world-size")
    ref, ref_nbar = reference(trees, n, STEPS, LR, normalization="world-size")
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5, msg=f"{name}, n={n}: models")
    torch.testing.assert_close(relay_n, ref_nbar.mean(1), rtol=0, atol=0, msg=f"{name}: n̄")
    # the rule is not the seed's: they differ while some n̄_i < n (here by > 0.1 at the first step)
    seeds, _ = reference(trees, n, STEPS, LR)
    assert float((ref[0] - seeds[0]).abs().max()) > 0.1
    assert ref_nbar[0].lt(n).any() and ref_nbar[-1].eq(n).all()


@pytest.mark.parametrize("name", TREE_NAMES)
@pytest.mark.parametrize("n", [3, 5, 8])
def test_world_size_first_step_in_closed_form(name, n):
    """At t = 0 a node has heard exactly its tree neighbours: x_i^1 = (x_i^{1/2} + Σ_{j~i} x_j^{1/2}
    + (n - 1 - deg_i) x_i^0) / n on a single tree; per coordinate range on double trees."""
    trees = build_relay_trees(name, n)
    ref, _ = reference(trees, n, 1, LR, normalization="world-size")
    x0 = torch.stack([initial(r) for r in range(n)])
    half = torch.stack([local_step(r, x0[r], LR) for r in range(n)])
    for tree, sl in zip(trees, coordinate_slices(DIM, len(trees))):
        for i in range(n):
            nbrs = tree.neighbors(i)
            expected = (half[i, sl] + half[nbrs, sl].sum(0) + (n - 1 - len(nbrs)) * x0[i, sl]) / n
            torch.testing.assert_close(ref[0, i, sl], expected, rtol=0, atol=1e-12)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name,n", [("chain", 5), ("chain", 8), ("binary-tree", 8), ("double-binary-trees", 8)])
def test_pure_averaging_mean_is_kept_at_the_first_step_only(name, n):
    """γ = 0, distinct initial models. The world-size rule keeps the nodes' mean model exactly at
    the first step (a tree's edges are symmetric: what node i lacks of node k, node k lacks of i,
    and each fills with its own), the seed's rule does not. From the second step on neither keeps
    it: a node's model reaches the others with different delays, so it counts for different
    nodes at different ages. Measured here: first step 1e-16 against 0.07-0.37 (counters); steps
    2-10 off by 0.03-0.2 under both rules."""
    trees = build_relay_trees(name, n)
    x0 = torch.stack([initial(r) for r in range(n)])
    deviation = {}
    for normalization in NORMALIZATIONS:
        ref, _ = reference(trees, n, 10, lr=0.0, normalization=normalization)
        deviation[normalization] = (ref.mean(1) - x0.mean(0)).abs().amax(1)  # per step: max |mean - mean^0|
    assert float(deviation["world-size"][0]) < 1e-12
    assert float(deviation["counters"][0]) > 0.05
    assert float(deviation["world-size"][1:].max()) > 1e-2
    assert float(deviation["counters"][1:].max()) > 1e-2
    if name == "double-binary-trees":  # the same on the wire
        got, _ = run_relaysgd(name, n, 3, lr=0.0, normalization="world-size")
        torch.testing.assert_close(got.mean(1)[0], x0.mean(0), rtol=0, atol=1e-6)


@pytest.mark.parametrize("normalization", NORMALIZATIONS)
@pytest.mark.parametrize("name,n", [("chain", 5), ("chain", 8), ("binary-tree", 8), ("double-binary-trees", 8)])
def test_relaysgd_moves_at_one_over_one_plus_the_mean_delay(name, n, normalization):
    """Why RelaySGD wants a larger learning rate than all-reduce (the seed's and the paper's tuning
    give it one; `reproduce relaysgd` uses one for all): with the same gradient g on every node,
    once the relays are full every model moves by γ g / (1 + δ̄) per step, δ̄ = mean over node
    pairs of the delay max(d_ij - 1, 0) at which j's half-step model reaches i (neighbours in the
    same step). All-reduce moves by γ g. 8 nodes on (double) binary trees: 0.43; chain: 0.36.
    Both normalizations alike: they differ only while some n̄_i < n."""
    trees = build_relay_trees(name, n)

    def constant(rank, x, lr):
        return x - lr * DIRECTION

    ref, _ = reference(trees, n, 250, LR, normalization=normalization, x0=torch.zeros(n, DIM, dtype=torch.float64),
                       local=constant)
    expected_delay = {("chain", 5): 4 / 5, ("chain", 8): 7 / 4, ("binary-tree", 8): 43 / 32,
                      ("double-binary-trees", 8): 43 / 32}[(name, n)]  # both trees of a pair alike
    for tree, sl in zip(trees, coordinate_slices(DIM, len(trees))):
        mean_delay = sum(max(d - 1, 0) for i in range(n) for d in tree.distances(i)) / n ** 2
        assert mean_delay == pytest.approx(expected_delay, abs=1e-15)
        per_step = ref[-1, :, sl] - ref[-2, :, sl]
        torch.testing.assert_close(per_step, (-LR * DIRECTION[sl] / (1 + mean_delay)).expand_as(per_step),
                                   rtol=0, atol=1e-9)


@pytest.mark.parametrize("name", TREE_NAMES)
@pytest.mark.parametrize("n", [5, 8, 13])
def test_reference_consensus_shrinks(name, n):
    x0 = torch.stack([initial(r) for r in range(n)])
    ref, nbar = reference(build_relay_trees(name, n), n, 40, lr=0.0)
    assert consensus_distance(ref[-1]) < 0.05 * consensus_distance(x0)
    assert consensus_distance(ref[19]) < 0.2 * consensus_distance(x0)
    assert nbar[-1].eq(n).all()


# RelaySum on its own ---------------------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", TREE_NAMES)
@pytest.mark.parametrize("n", [5, 8])
def test_relay_sum_of_fixed_inputs_is_exact_after_diameter_steps(name, n):
    """Every node relays a fixed v_i: after step t node i holds exactly the v_j within t+1 hops,
    so after `diameter` steps the uniform average of all v, with counts summing to n."""
    trees = build_relay_trees(name, n)
    steps = max(t.diameter() for t in trees)
    v = torch.stack([initial(r) for r in range(n)])

    def body(rank, comm):
        relays = [RelaySum(comm, tree, f"tree{k}") for k, tree in enumerate(trees)]
        mine = v[rank].float()
        for relay in relays:
            relay.expect(mine)
        comm.ready()
        trace = []
        for step in range(steps):
            comm.set_step(step)
            for relay in relays:
                relay.post(step, mine)
            for relay in relays:
                relay.collect(step)
            trace.append([(relay.average(mine).double(), relay.n_bar) for relay in relays])
        for relay in relays:
            relay.drain()
        return trace

    traces = run_cluster(n, body, timeout=30)
    for k, tree in enumerate(trees):
        for i in range(n):
            dist = tree.distances(i)
            for t in range(steps):
                heard = [j for j in range(n) if dist[j] <= t + 1]
                avg, n_bar = traces[i][t][k]
                assert n_bar == len(heard)
                torch.testing.assert_close(avg, v[heard].mean(0), rtol=0, atol=1e-6)
            avg, n_bar = traces[i][-1][k]
            assert n_bar == n
            torch.testing.assert_close(avg, v.mean(0), rtol=0, atol=1e-6)
    # the same holds in the reference recursion (relaying fixed inputs) to float64 precision
    ref, nbar = reference(trees, n, steps, lr=0.0, relay_fixed=v)
    torch.testing.assert_close(ref[-1], v.mean(0).expand(n, DIM), rtol=0, atol=1e-12)
    assert nbar[-1].eq(n).all()


# Lost messages are fatal -----------------------------------------------------------------------
class _AllLive:
    def live(self, peers):
        return list(peers)


class _FakeComm:
    rank, world_size = 0, 2
    link_deadline = 1.0
    membership = _AllLive()

    def __init__(self, ack: Delivery | Exception = Delivery(True)):
        self.ack = ack

    def expect(self, *args, **kwargs):
        pass

    def ready(self):
        pass

    def make_room(self, peer, window):
        return True

    def send(self, peer, tensor, **header):
        future = concurrent.futures.Future()
        if isinstance(self.ack, Exception):
            future.set_exception(self.ack)
        else:
            future.set_result(self.ack)
        return future


@pytest.mark.parametrize("ack", [Delivery(False, reason="bad_size", detail="x"),
                                 ConnectionError("peer gone")])
def test_refused_or_failed_relay_message_is_dropped_not_fatal(ack, caplog):
    """A lost relay message is dropped (the receiver drops it with its count): the sender logs it
    and trains on; it must not take the node down."""
    relay = RelaySum(_FakeComm(ack), Chain(2), "tree0")
    relay.expect(torch.zeros(3))
    relay.post(0, torch.ones(3))
    with caplog.at_level("DEBUG", logger="p2ptrain.algorithms.relaysgd"):
        relay.drain()
    assert relay.unacknowledged == 0
    assert any("relay message" in r.getMessage() for r in caplog.records)


def test_a_lost_message_is_filled_with_the_own_model_under_world_size():
    """Node 0 of a 2-chain: with the neighbour's message lost (m = 0, c = 0) the seed's rule keeps
    x, the world-size rule averages x with the fill; with it received both are (x + m) / 2."""
    relay = RelaySum(_FakeComm(), Chain(2), "tree0")
    relay.expect(torch.zeros(3))
    x, m, fill = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([5.0, 6.0, 7.0]), torch.tensor([-1.0, 0.0, 1.0])
    relay.counts[1] = 0.0  # lost: collect() zeroes the message with its count
    assert relay.n_bar == 1.0
    assert relay.average(x).tolist() == [1.0, 2.0, 3.0]
    assert relay.average(x, fill=fill).tolist() == [0.0, 1.0, 2.0]
    relay.messages[1].copy_(m)
    relay.counts[1] = 1.0
    assert relay.average(x).tolist() == relay.average(x, fill=fill).tolist() == [3.0, 4.0, 5.0]


# The option -------------------------------------------------------------------------------------
def test_normalization_option_reaches_the_algorithm():
    spec = registry.get("relaysgd")
    assert spec.options().relay_normalization == "counters"  # the seed's rule stays the default
    options = spec.parse_options({"relay_normalization": "world-size"})
    comm = SimpleNamespace(rank=0, world_size=4)
    alg = registry.build("relaysgd", comm, options, registry.BuildContext("chain"))
    assert alg.normalization == "world-size" and alg.fills_missing
    assert not registry.build("relaysgd", comm, RelaySGDOptions(), registry.BuildContext("chain")).fills_missing
    with pytest.raises(ValueError, match=r"^unknown relay_normalization 'mean'; choose from counters, world-size$"):
        spec.parse_options({"relay_normalization": "mean"})
    with pytest.raises(ValueError, match=r"^unknown relay normalization 'n'; choose from counters, world-size$"):
        RelaySGD(comm, "chain", normalization="n")


def test_world_size_keeps_its_fill_across_checkpoints_and_catch_ups():
    """The fill x_i^{(t)} is state: the checkpoint carries it, and a node that catches up fills
    with the donor's model it continues from, not its stale one."""
    x0, x1 = torch.arange(4.0), torch.full((4,), 9.0)
    alg = RelaySGD(_FakeComm(), "chain", normalization="world-size")
    alg.setup(x0.clone())
    state = alg.state_dict()
    assert state["previous"].tolist() == x0.tolist()
    resumed = RelaySGD(_FakeComm(), "chain", normalization="world-size")
    resumed.setup(x1.clone())
    resumed.load_state_dict(state, step=3)
    assert resumed.previous.tolist() == x0.tolist()
    adopted = resumed.adopt_state(SimpleNamespace(tensor=x1, sender=1, step=3), x0.clone())
    assert adopted.tolist() == resumed.previous.tolist() == x1.tolist()
    counters = RelaySGD(_FakeComm(), "chain")
    counters.setup(x0.clone())
    assert "previous" not in counters.state_dict() and counters.previous is None
