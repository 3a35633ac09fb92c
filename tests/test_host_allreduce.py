"""All-reduce through one host's shared memory (algorithms/host_allreduce.py over transport/host_memory.py):
exact means with every member's bits alike, the ring where members are on other hosts, and calls that
fail on every member (input untouched) when one gives a step up or holds NaN, after which the next
call completes."""
from __future__ import annotations

import mmap
import multiprocessing
import resource
import time

import pytest
import torch

from p2ptrain.algorithms.collectives import CollectiveIncomplete, RingAllReduce
from p2ptrain.algorithms.host_allreduce import HostAllReduce
from p2ptrain.communicator import Communicator
from p2ptrain.transport import Transport, TransportOptions, host_memory, shared_segment
from p2ptrain.transport.faults import LinkTable
from tests.cluster import run_cluster

pytestmark = pytest.mark.skipif(not host_memory.supported(), reason="host regions need Linux on x86-64")


def read_published(offer, rounds, results) -> None:
    """(child process) Wait for each of `rounds` publications of the parent's region; report what was
    seen torn (a word pair or data not of one publication) and the CPU seconds spent waiting."""
    region = host_memory.PeerRegion.open(*offer, 64)
    torn, seen = 0, 0
    began = resource.getrusage(resource.RUSAGE_SELF)
    while seen < rounds:
        generation = region.generation()
        words = region.read()
        if words[0] > seen:
            seen = words[0]
            torn += words[1] != 2 * words[0] or int(region.data[0]) != words[0] % 256
            continue
        region.wait(generation, 5.0)
    used = resource.getrusage(resource.RUSAGE_SELF)
    results.put((seen, torn, used.ru_utime + used.ru_stime - began.ru_utime - began.ru_stime))


def test_a_region_wakes_a_reader_in_another_process_which_reads_each_publication_whole_without_spinning():
    own = host_memory.OwnRegion(64)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    child = context.Process(target=read_published, args=(own.offer, 20, results))
    child.start()
    try:
        time.sleep(2.0)  # (the child imports torch and maps the region meanwhile, then sleeps on it)
        for k in range(1, 21):
            own.data[0] = k % 256
            own.publish(k, 2 * k)
            time.sleep(0.05)
        seen, torn, cpu_seconds = results.get(timeout=60)
    finally:
        child.join(timeout=30)
        own.close()
    assert seen == 20 and torn == 0
    assert cpu_seconds < 0.5  # ~1 s of waiting asleep on the futex, not polling


def test_a_peer_region_refuses_a_wrong_nonce_or_size():
    own = host_memory.OwnRegion(64)
    pid, fd, nonce = own.offer
    with pytest.raises(ValueError, match="nonce"):
        host_memory.PeerRegion.open(pid, fd, nonce ^ 1, 64)
    with pytest.raises(ValueError, match="holds"):
        host_memory.PeerRegion.open(pid, fd, nonce, 128)
    own.close()


def inputs(rank: int, step: int, numel: int) -> torch.Tensor:
    return torch.arange(numel, dtype=torch.float32) * (rank + 1) + step * 7 - rank


def member_order_mean(n: int, step: int, numel: int, average: bool) -> torch.Tensor:
    total = inputs(0, step, numel).clone()
    for rank in range(1, n):
        total += inputs(rank, step, numel)
    return total / n if average else total


@pytest.mark.parametrize("n,numel", [(2, 1000), (3, 5), (4, 3), (4, 4097)])
@pytest.mark.parametrize("average,in_place", [(True, False), (False, True)])
def test_host_all_reduce_gives_every_member_the_exact_mean_with_the_same_bits(n, numel, average, in_place):
    steps = 4

    def body(rank, comm):
        host = HostAllReduce(comm, RingAllReduce(comm, numel, torch.float32, elastic=True))
        comm.ready()
        outs = []
        for step in range(steps):
            tensor = inputs(rank, step, numel)
            out = None if in_place else torch.full_like(tensor, float("nan"))
            result = host(tensor, step, average=average, members=tuple(range(n)), out=out)
            assert result is (tensor if in_place else out)
            if not in_place:
                assert torch.equal(tensor, inputs(rank, step, numel))  # only read
            outs.append(result.clone())
        return outs, host.rounds

    results = run_cluster(n, body)
    for step in range(steps):
        expected = member_order_mean(n, step, numel, average)
        for outs, rounds in results:
            assert rounds == steps  # through shared memory, not the ring
            assert torch.equal(outs[step], expected)


def test_members_on_other_hosts_stay_on_the_ring():
    n, numel = 3, 10

    def body(rank, comm):
        host = HostAllReduce(comm, RingAllReduce(comm, numel, torch.float32, elastic=True))
        comm.ready()
        out = host(inputs(rank, 0, numel), 0, average=True, members=tuple(range(n)), out=torch.empty(numel))
        return out, host.rounds, host.region

    results = run_cluster(n, body, host_of=lambda rank: "127.0.0.1" if rank else "127.0.0.2")
    for out, rounds, region in results:
        torch.testing.assert_close(out, member_order_mean(n, 0, numel, True))
        assert rounds == 0 and region is None  # (no region is even made)


def test_a_member_that_skips_a_step_fails_that_call_on_the_others_and_the_next_call_completes_on_all():
    n, numel = 3, 50
    options = TransportOptions(send_timeout=30.0, link_deadline=1.0)

    def body(rank, comm):
        host = HostAllReduce(comm, RingAllReduce(comm, numel, torch.float32, elastic=True))
        comm.ready()
        outcomes = {}
        for step in range(4):
            if rank == 2 and step == 1:
                continue  # (its ring skipped the step: a pending view dropped a member, as it saw it)
            tensor = inputs(rank, step, numel)
            try:
                host(tensor, step, average=True, members=tuple(range(n)))
            except CollectiveIncomplete:
                assert torch.equal(tensor, inputs(rank, step, numel))  # in place, restored
                outcomes[step] = None
                continue
            outcomes[step] = tensor
        return outcomes, host.rounds

    results = run_cluster(n, body, options=options)
    for rank, (outcomes, rounds) in enumerate(results):
        if rank < 2:
            assert outcomes[1] is None
        for step in (0, 2, 3):  # node 2 kept its agreement through step 1: it agrees again at step 2
            assert torch.equal(outcomes[step], member_order_mean(n, step, numel, True))
        assert rounds == 3


def test_a_member_with_nan_fails_the_call_on_every_member_and_the_next_call_completes():
    n, numel = 3, 30

    def body(rank, comm):
        host = HostAllReduce(comm, RingAllReduce(comm, numel, torch.float32, elastic=True))
        comm.ready()
        tensor = inputs(rank, 0, numel)
        if rank == 1:
            tensor[numel // 2] = float("nan")
        kept = tensor.clone()
        with pytest.raises(CollectiveIncomplete):
            host(tensor, 0, average=True, members=tuple(range(n)))
        assert torch.equal(tensor, kept) if rank != 1 else torch.equal(tensor.nan_to_num(), kept.nan_to_num())
        out = host(inputs(rank, 1, numel), 1, average=True, members=tuple(range(n)), out=torch.empty(numel))
        return out, host.rounds

    for out, rounds in run_cluster(n, body):
        assert torch.equal(out, member_order_mean(n, 1, numel, True)) and rounds == 1


@pytest.mark.parametrize("options,region", [
    (TransportOptions(), True),
    (TransportOptions(links=LinkTable.parse("")), True),  # (a table that emulates nothing)
    (TransportOptions(links=LinkTable.parse("latency=1ms")), False),  # the network --link describes stands between
    (TransportOptions(links=LinkTable.parse("", bursts=["0->1@10+20:drop=0.5"])), False),
    (TransportOptions(shared_memory=False), False),
])
def test_a_communicator_offers_host_memory_only_where_nothing_stands_between_the_nodes(options, region):
    peers = ["127.0.0.1:1", "127.0.0.1:2"]
    comm = Communicator(Transport(0, 2, peers, listen=peers[0], options=options))
    made = comm.host_region(64)
    assert (made is not None) == region
    if made is not None:
        made.close()
    comm.close()


def test_a_region_left_mid_publication_reads_as_nothing_instead_of_hanging_its_readers():
    """An owner killed between the two stores of a publication leaves its generation odd: readers
    get None (which host_allreduce.py reads as a member still behind, until its deadline or death
    ends the wait), not an endless spin."""
    own = host_memory.OwnRegion(64)
    own.publish(5, 6)
    pid, fd, nonce = own.offer
    peer = host_memory.PeerRegion.open(pid, fd, nonce, 64)
    assert peer.read()[:2] == (5, 6)
    with open(f"/proc/{pid}/fd/{fd}", "r+b") as raw, mmap.mmap(raw.fileno(), 0) as mapped:
        generation = shared_segment.HEADER_BYTES
        mapped[generation:generation + 4] = (peer.generation() + 1).to_bytes(4, "little")  # (as if killed)
        assert peer.read() is None
        mapped[generation:generation + 4] = (peer.generation() + 1).to_bytes(4, "little")
    assert peer.read()[:2] == (5, 6)
    peer.close()
    own.close()


@pytest.mark.parametrize("offer", [(-1, 3, 5), (0, 3, 5), (1, -3, 5), (2**40, 3, 5), ("own", 2**70, None),
                                   ("own", -5, None), ("own", None, -7), ("own", None, 2**64)])
def test_an_absurd_offer_from_a_peer_is_refused_with_a_value_error(offer):
    """What a buggy or hostile member can put in the offers all-reduce: any finite numbers. Each is
    a ValueError (the member stays on the ring), never another exception out of the round."""
    own = host_memory.OwnRegion(64)
    pid, fd, nonce = own.offer
    offer = tuple(mine if given in ("own", None) else given for given, mine in zip(offer, (pid, fd, nonce)))
    with pytest.raises(ValueError):
        host_memory.PeerRegion.open(*offer, 64)
    own.close()
