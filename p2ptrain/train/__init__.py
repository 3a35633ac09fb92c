"""Training loop, models, data sets and evaluation."""
from p2ptrain.train.flat import FlatParameters
from p2ptrain.train.loop import DecentralizedTrainer, StepRecord, TrainResult, cycle, pick_device

__all__ = ["DecentralizedTrainer", "FlatParameters", "StepRecord", "TrainResult", "cycle", "pick_device"]
