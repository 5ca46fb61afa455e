"""What ``one-embedding train`` prints when a run ends: a few lines, each figure named.

    >>> print(train_summary({"model": "dlrm", "store": "device_mem", "engine": None, "steps": 300,
    ...     "samples": 307200, "train_seconds": 18.7, "samples_per_s": 61519.2,
    ...     "samples_per_s_all": 16451.6, "steady_after_steps": 30, "loss_first_10pct": 0.5863,
    ...     "loss_last_10pct": 0.4054, "auc": 0.8504, "logloss": 0.4006, "eval_samples": 20480,
    ...     "rows_stored": 174764, "top_tier_hit_rate": 0.86, "optimizer": "adagrad", "lr": 0.05}))
    dlrm, 300 steps of 1,024 samples, adagrad lr 0.05, store device_mem: 18.7 s of training
      eval:       AUC 0.8504, logloss 0.4006 (20,480 held-out samples)
      train loss: 0.5863 -> 0.4054 (mean step loss of the first 10% of steps -> of the last 10%)
      samples/s:  61,519 steady state (steps after the first 30), 16,452 all steps
      table:      174,764 rows stored, 86.0% of lookups hit the top tier

The JSON record behind it (``event: "final"``) keeps every figure under its own key
(``samples_per_s``: steady state; ``samples_per_s_all``: every step).
"""
from __future__ import annotations

import math


def _number(value, fmt: str) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) \
        else format(value, fmt)


def train_summary(final: dict, metrics_path: str | None = None,
                  checkpoint: str | None = None) -> str:
    """The lines for ``final`` (``Trainer.finish``'s record); ``metrics_path`` and
    ``checkpoint`` (where the final checkpoint is) are named when given."""
    steps = final["steps"]
    batch = final["samples"] // steps if steps else 0
    store = final["store"] + (f":{final['engine']}" if final.get("engine") else "")
    skip = final.get("steady_after_steps", 0)
    steady = (f"steady state (steps after the first {skip:,})" if skip
              else "steady state (every step)")
    lines = [
        f"{final['model']}, {steps:,} steps of {batch:,} samples, {final['optimizer']} lr {final['lr']:g}, "
        f"store {store}: {final['train_seconds']:.1f} s of training",
        f"  eval:       AUC {_number(final['auc'], '.4f')}, logloss "
        f"{_number(final['logloss'], '.4f')} ({final['eval_samples']:,} held-out samples)"
        if final.get("eval_samples") else
        "  eval:       none: the held-out split gave no full batch (raise --eval-fraction, or "
        "lower --batch-size: evaluation reads whole batches)",
        f"  train loss: {final['loss_first_10pct']:.4f} -> {final['loss_last_10pct']:.4f} (mean "
        "step loss of the first 10% of steps -> of the last 10%)",
        f"  samples/s:  {_number(final['samples_per_s'], ',.0f')} {steady}, "
        f"{_number(final['samples_per_s_all'], ',.0f')} all steps",
        f"  table:      {final['rows_stored']:,} rows stored, "
        f"{_number(100 * final['top_tier_hit_rate'], '.1f')}% of lookups hit the top tier",
    ]
    if final.get("skipped_lines"):
        lines.append(f"  input:      {final['skipped_lines']:,} malformed lines skipped "
                     "(--on-bad-line skip)")
    if checkpoint:
        lines.append(f"  checkpoint: {checkpoint}")
    if metrics_path:
        lines.append(f"  metrics:    {metrics_path} (JSON lines; the last one holds every figure)")
    return "\n".join(lines)
