"""Serving a training run's snapshots: ``Predictor`` in-process, ``one-embedding serve`` over
the Open Inference Protocol (``server``, needs the ``serve`` extra)."""
from .predictor import NotReadyError, Predictor

__all__ = ["NotReadyError", "Predictor"]
