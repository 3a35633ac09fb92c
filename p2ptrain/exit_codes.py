"""The exit codes of `p2ptrain node`, `p2ptrain launch` and of scripts that call p2ptrain.init():
one table, because the launcher reads them from processes it did not write (your script)."""

EXIT_OK = 0
EXIT_FAILED = 1          # a node failed; `launch` names it and still writes report.json
EXIT_CONFIG = 2          # a configuration error, said in one line before anything started
EXIT_NO_CLUSTER = 3      # a node told to rejoin (--rejoin, P2PTRAIN_REJOIN=1) found no live peer: the run had ended
EXIT_NON_FINITE = 4      # the node's loss or model became NaN/Inf (its summary says at which step)

__all__ = ["EXIT_CONFIG", "EXIT_FAILED", "EXIT_NON_FINITE", "EXIT_NO_CLUSTER", "EXIT_OK"]
