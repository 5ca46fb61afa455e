"""Serving a training run's snapshots: ``Predictor`` in-process, ``one-embedding serve`` over
the Open Inference Protocol (``server``, needs the ``serve`` extra)."""
from .predictor import Predictor

__all__ = ["Predictor"]
