"""Optimizers that update embedding lines and dense parameters in place, LR schedules, loss scaling.

``RowOptimizer.update(w, states, g, step)`` rewrites ``w`` and its state arrays (views into the
lines ``[w | state1 | state2]`` of the unique rows of a step, or whole dense parameters).
Arguments and defaults follow OneFlow's optimizers (``SGD(params, lr=0.001, momentum=0.0, ...)``).
Importing this package never imports cupy; CuPy arrays are recognised when they arrive.
"""
from one_embedding.optim.base import DEFAULT_LR, WEIGHT_DECAY_MODES, RowOptimizer
from one_embedding.optim.loss_scale import LossScaler
from one_embedding.optim.lr_schedules import (LinearWarmup, LRSchedule, MultiStepLR,
                                              PolynomialDecay, WarmupPolynomialDecay)
from one_embedding.optim.ftrl import FTRL_CONVENTIONS, Ftrl
from one_embedding.optim.row_optimizers import SGD, Adagrad, Adam
from one_embedding.optim.smart_decay_adam import SmartDecayAdam

__all__ = ["RowOptimizer", "SGD", "Adagrad", "Adam", "Ftrl", "SmartDecayAdam", "LossScaler",
           "DEFAULT_LR",
           "WEIGHT_DECAY_MODES", "FTRL_CONVENTIONS",
           "LRSchedule", "LinearWarmup", "PolynomialDecay", "WarmupPolynomialDecay", "MultiStepLR"]
