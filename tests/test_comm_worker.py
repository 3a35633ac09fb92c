"""The engine's communication worker (p2ptrain/comm_worker.py): one FIFO thread per node that runs
the algorithms' background collectives, and algorithms that start no thread of their own."""
from __future__ import annotations

import ast
import concurrent.futures
import threading
from pathlib import Path

import pytest
import torch

from p2ptrain.algorithms.allreduce import AllReduceSGD
from p2ptrain.algorithms.diloco import DiLoCo
from p2ptrain.algorithms.pipesgd import PipeSGD
from p2ptrain.comm_worker import CommWorker
from tests.cluster import run_cluster
from tests.conftest import ROOT

ALGORITHMS = Path(ROOT) / "p2ptrain" / "algorithms"


def test_jobs_run_one_at_a_time_in_submission_order_on_one_named_thread():
    worker = CommWorker("comm-worker-7")
    ran, threads, running = [], set(), []

    def job(i):
        running.append(i)
        assert len(running) == 1  # never two at once
        ran.append(i)
        threads.add(threading.current_thread().name)
        running.pop()
        return i * i

    futures = [worker.submit(job, i) for i in range(50)]
    assert [f.result(timeout=10) for f in futures] == [i * i for i in range(50)]
    assert ran == list(range(50)) and threads == {"comm-worker-7"}
    worker.close()


def test_a_failing_job_hands_its_exception_to_its_future_and_the_next_jobs_still_run():
    worker = CommWorker()

    def fail():
        raise ValueError("segment missing")

    failed = worker.submit(fail)
    after = worker.submit(lambda x, y=0: x + y, 2, y=3)
    with pytest.raises(ValueError, match="segment missing"):
        failed.result(timeout=10)
    assert after.result(timeout=10) == 5
    worker.close()


def test_close_cancels_queued_jobs_joins_the_running_one_and_refuses_new_ones():
    worker = CommWorker("comm-worker-0")
    release, started = threading.Event(), threading.Event()

    def blocking():
        started.set()
        release.wait(10)
        return "done"

    running = worker.submit(blocking)
    queued = worker.submit(lambda: "never")
    assert started.wait(10)
    closer = threading.Thread(target=worker.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive()  # close() waits for the job running
    release.set()
    closer.join(10)
    assert not closer.is_alive() and worker.closed
    assert running.result() == "done" and queued.cancelled()
    with pytest.raises(RuntimeError, match="closed"):
        worker.submit(lambda: None)
    assert all(t.name != "comm-worker-0" for t in threading.enumerate())  # the thread has ended
    worker.close()  # idempotent


def test_a_worker_starts_its_thread_with_its_first_job_and_each_node_has_its_own():
    before = {t.name for t in threading.enumerate()}
    idle, a, b = CommWorker("comm-worker-idle"), CommWorker("comm-worker-a"), CommWorker("comm-worker-b")
    assert a.submit(threading.current_thread).result(10).name == "comm-worker-a"
    assert b.submit(threading.current_thread).result(10).name == "comm-worker-b"
    names = {t.name for t in threading.enumerate()} - before
    assert {"comm-worker-a", "comm-worker-b"} <= names and "comm-worker-idle" not in names
    for worker in (idle, a, b):
        worker.close()


def test_no_algorithm_module_imports_threads_or_executors():
    """Overlap is the engine's (Comm.background): algorithm modules neither import threading nor
    make executors, processes or timers."""
    forbidden_modules = {"threading", "_thread", "multiprocessing", "asyncio"}
    forbidden_names = {"ThreadPoolExecutor", "ProcessPoolExecutor", "Thread", "Timer"}
    offenders = []
    for path in sorted(ALGORITHMS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                offenders += [(path.name, a.name) for a in node.names if a.name.split(".")[0] in forbidden_modules]
            elif isinstance(node, ast.ImportFrom):
                if (node.module or "").split(".")[0] in forbidden_modules:
                    offenders.append((path.name, node.module))
                offenders += [(path.name, a.name) for a in node.names if a.name in forbidden_names]
            elif isinstance(node, ast.Attribute) and node.attr in forbidden_names:
                offenders.append((path.name, node.attr))
    assert offenders == []


def _allreduce_overlap(comm, x):
    algo = AllReduceSGD(comm, average="models", overlap=1)
    x = algo.setup(x)
    for step in range(4):
        x = algo.after_step(step, x + comm.rank)
    return algo, algo.finish()


def _pipesgd(comm, x):
    algo = PipeSGD(comm)
    x = algo.setup(x)
    for step in range(4):
        g = algo.reduce_gradients(step, x * 0 + comm.rank + step)
        x = algo.after_step(step, x if g is None else x - 0.1 * g)
    algo.finish()  # (completes the last mean; the model is x)
    return algo, x


def _streaming_diloco(comm, x):
    algo = DiLoCo(comm, inner_steps=2, fragments=2, outer_delay=1)
    x = algo.setup(x)
    for step in range(6):
        x = algo.after_step(step, x - 0.01 * (comm.rank + 1))
    return algo, algo.finish()


@pytest.mark.parametrize("run", [_allreduce_overlap, _pipesgd, _streaming_diloco],
                         ids=["allreduce-overlap", "pipesgd", "streaming-diloco"])
def test_overlapping_algorithms_run_their_collectives_on_the_nodes_worker_and_start_no_thread(run, monkeypatch):
    """Two in-process nodes: each algorithm's background collectives run on its own node's
    comm-worker, and the only thread started from the nodes' code is that worker."""
    started, start = [], threading.Thread.start

    def recording_start(thread):
        started.append((threading.current_thread().name, thread.name))
        return start(thread)

    monkeypatch.setattr(threading.Thread, "start", recording_start)

    def body(rank, comm):
        ran_on, background = [], comm.background

        def spy(fn, *args, **kwargs):
            def job():
                ran_on.append(threading.current_thread().name)
                return fn(*args, **kwargs)
            return background(job)

        comm.background = spy
        me = threading.current_thread().name
        _, final = run(comm, torch.zeros(12))
        return me, ran_on, final

    results = run_cluster(2, body)
    for rank, (me, ran_on, _) in enumerate(results):
        assert ran_on and set(ran_on) == {f"comm-worker-{rank}"}
        assert [name for creator, name in started if creator == me] == [f"comm-worker-{rank}"]
    assert torch.equal(results[0][2], results[1][2])  # and the nodes end with the same model


def test_communicator_close_stops_its_worker():
    def body(rank, comm):
        assert comm.background(lambda: threading.current_thread().name).result(10) == f"comm-worker-{rank}"
        return comm

    comms = run_cluster(2, body)  # run_cluster closes the communicators, as a node's close does
    for comm in comms:
        with pytest.raises(RuntimeError, match="closed"):
            comm.background(lambda: None)
    names = {t.name for t in threading.enumerate()}
    assert "comm-worker-0" not in names and "comm-worker-1" not in names


def test_background_futures_are_concurrent_futures():
    worker = CommWorker()
    future = worker.submit(sum, [1, 2, 3])
    assert isinstance(future, concurrent.futures.Future) and future.result(10) == 6
    worker.close()
