"""Training: the optimizer wrapper and a ready-made loop, the model state vector, setup, evaluation,
the run folder's files, models, data sets and partitions."""
from p2ptrain.train.device import pick_device
from p2ptrain.train.loop import DecentralizedTrainer, TrainResult, cycle
from p2ptrain.train.optimizer import DecentralizedOptimizer, NonFiniteError
from p2ptrain.train.state import ModelState

__all__ = ["DecentralizedOptimizer", "DecentralizedTrainer", "ModelState", "NonFiniteError", "TrainResult", "cycle",
           "pick_device"]
