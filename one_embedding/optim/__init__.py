"""Optimizers that update embedding lines and dense parameters in place, and LR schedules.

``RowOptimizer.update(w, states, g, step)`` rewrites ``w`` and its state arrays (views into the
lines ``[w | state1 | state2]`` of the unique rows of a step, or whole dense parameters).
Importing this package never imports cupy; CuPy arrays are recognised when they arrive.
"""
from one_embedding.optim.lr_schedules import (LinearWarmup, LRSchedule, MultiStepLR,
                                              PolynomialDecay, WarmupPolynomialDecay)
from one_embedding.optim.row_optimizers import SGD, Adagrad, Adam, Ftrl, RowOptimizer

__all__ = ["RowOptimizer", "SGD", "Adagrad", "Adam", "Ftrl",
           "LRSchedule", "LinearWarmup", "PolynomialDecay", "WarmupPolynomialDecay", "MultiStepLR"]
