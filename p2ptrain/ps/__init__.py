"""Parameter-server role (seed 001, GEM): a server holding the central variable θ and its version,
asynchronous workers that pull θ and commit scaled updates.

    server.py   ParameterServer (grpc.aio on its own event-loop thread), CentralVariable
    run.py      run_ps: `p2ptrain ps` (serve θ_0, write the run folder's files)
    client.py   PsClient: the worker's blocking Pull / Commit / Done calls (grpc sync API)
    worker.py   run_worker (Algorithm 1 with Ψ = gem | downpour | adaptive-staleness), run_proxy

The update rules themselves are in p2ptrain/algorithms/gem.py.
"""
from p2ptrain.ps.client import PsClient, PsError
from p2ptrain.ps.run import run_ps
from p2ptrain.ps.server import AppliedCommit, CentralVariable, ParameterServer, ps_fingerprint
from p2ptrain.ps.worker import run_proxy, run_worker

__all__ = ["ParameterServer", "CentralVariable", "AppliedCommit", "PsClient", "PsError", "ps_fingerprint",
           "run_ps", "run_worker", "run_proxy"]
