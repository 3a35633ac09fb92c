"""Local cluster launcher: starts N `p2ptrain node` processes on this machine, shows their
progress, stops them all on the first failure and summarises the run (report.json + plot.png).

It only relies on the files nodes write into the run folder, so it stays independent of the
node implementation.

`launcher.compose` generates docker-compose files and `launcher.prometheus` scrape configs
(`p2ptrain compose`; `p2ptrain launch` writes OUT/prometheus.yml); Grafana files are in launcher/grafana/.
"""
from .local import ClusterError, run_local_cluster

__all__ = ["ClusterError", "run_local_cluster"]
