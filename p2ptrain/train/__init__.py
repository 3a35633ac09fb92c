"""Training: the optimizer wrapper and a ready-made loop, the model state vector, setup, evaluation,
the run folder's files, models, data sets and partitions."""
from p2ptrain.train.device import pick_device
from p2ptrain.train.errors import LeftCluster, NonFiniteError
from p2ptrain.train.optimizer import DecentralizedOptimizer
from p2ptrain.train.state import ModelState
from p2ptrain.train.trainer import DecentralizedTrainer, TrainResult, cycle

__all__ = ["DecentralizedOptimizer", "DecentralizedTrainer", "LeftCluster", "ModelState", "NonFiniteError",
           "TrainResult", "cycle", "pick_device"]
