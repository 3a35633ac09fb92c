"""One file per algorithm of the seeds, each in the seed's own notation."""
from p2ptrain.algorithms.base import Algorithm
from p2ptrain.algorithms.sgp import SGP

ALGORITHM_NAMES = ("sgp",)

__all__ = ["Algorithm", "SGP", "ALGORITHM_NAMES"]
