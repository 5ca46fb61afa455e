"""What a training reports and where it stands: ``TrainProgress`` (step, loader position, the
metric accumulators, saved in every checkpoint), ``MetricsWriter`` (the JSON-lines records) and
the progress bar's figures (``progress_postfix``)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np


class MetricsWriter:
    """JSON lines: appended to the file ``path`` when given, and to stdout when ``stdout`` (None:
    stdout when there is no file, the Python API's default).

    Records (``"event"``): ``config`` (every TrainConfig field), ``resume``, ``train`` every
    ``log_interval`` steps (``loss``: that step's loss; ``samples_per_s``: over every step so far),
    ``eval`` and ``final`` (``Trainer.finish``)."""

    def __init__(self, path: str | None, stdout: bool | None = None):
        self._file = open(path, "a") if path else None
        self._stdout = (not path) if stdout is None else bool(stdout)

    def write(self, record: dict) -> None:
        line = json.dumps(record, default=float)
        if self._file:
            self._file.write(line + "\n")
            self._file.flush()
        if self._stdout:
            print(line, flush=True)

    def close(self) -> None:
        if self._file:
            self._file.close()


PHASES = ("wait", "embedding", "dense", "update")


@dataclass
class TrainProgress:
    """Where a training stands: step and loader position, and the metric accumulators.

    ``epoch`` / ``batches_in_epoch`` locate the next batch in the loader; ``losses`` holds one
    loss per step (the head / tail means of the final record); ``steady_*`` leave out the first
    ``skip_steps`` steps.
    """

    step: int = 0
    epoch: int = 0
    batches_in_epoch: int = 0
    samples: int = 0
    losses: list = field(default_factory=list)
    train_seconds: float = 0.0
    steady_seconds: float = 0.0
    steady_samples: int = 0
    #: seconds per part of the step: waiting for prefetched rows, embedding (rows out, gradients
    #: in), dense (model and loss forward + backward), update (optimizer step)
    phase_seconds: dict = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

    def count(self, epoch: int, batch_size: int, loss, seconds: float,
              skip_steps: int) -> None:
        """One finished step of ``batch_size`` samples of ``epoch`` that took ``seconds``
        (``batch_size`` is the global batch); ``loss`` is a float, or None when the trainer
        reads it back later (``read_losses``)."""
        if epoch != self.epoch:
            self.epoch, self.batches_in_epoch = epoch, 0
        self.step += 1
        self.batches_in_epoch += 1
        self.samples += batch_size
        if loss is not None:
            self.losses.append(loss)
        self.train_seconds += seconds
        if self.step > skip_steps:
            self.steady_seconds += seconds
            self.steady_samples += batch_size


def progress_postfix(progress: TrainProgress, window: int = 20) -> str:
    """The progress bar's figures, each named: the mean step loss of the last ``window`` steps
    read back, and samples/s over every step so far."""
    recent = progress.losses[-window:]
    return (f"loss {np.mean(recent):.4f} (mean of last {len(recent)} steps), "
            f"{progress.samples / progress.train_seconds:,.0f} samples/s (all steps)")


#: a tier's counts of a run (``run_counts``); its rows and bytes are what it holds now
TIER_COUNTS = ("hits", "misses", "evictions", "writes", "d2h_bytes", "h2d_bytes", "d2h_copies",
               "h2d_copies")


def run_counts(stats: list[dict], before: list[dict]) -> list[dict]:
    """``stats`` (an embedding's ``store_stats()``, this process's counts) with ``before`` (the
    checkpoint's, a resumed run's) added, tier by tier: a resumed run's counts go on from its
    checkpoint's, as its steps do, where the tiers are the same (a cache added on resume starts
    at 0)."""
    if len(before) == len(stats):
        for now, then in zip(stats, before):
            if now["tier"] == then.get("tier"):
                for k in TIER_COUNTS:
                    if k in now and k in then:
                        now[k] += int(then[k])
    return stats
