"""Which torch device a node trains on."""
from __future__ import annotations

import torch


def pick_device(name: str = "auto") -> torch.device:
    """"auto": CUDA when present, else CPU; "cuda" fails clearly when CUDA is not there."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda requested but CUDA is not available")
    return torch.device(name)


__all__ = ["pick_device"]
