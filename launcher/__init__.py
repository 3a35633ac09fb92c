"""Local cluster launcher: starts N `p2ptrain node` processes on this machine, shows their
progress, stops them all on the first failure and summarises the run (report.json + plot.png).

It only relies on the files nodes write into the run folder, so it stays independent of the
node implementation.
"""
from .local import ClusterError, run_local_cluster

__all__ = ["ClusterError", "run_local_cluster"]
