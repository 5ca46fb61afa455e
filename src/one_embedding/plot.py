"""``one-embedding plot``: training curves of one or more runs from their metrics files.

A metrics file is what ``one-embedding train --metrics FILE`` appends: JSON lines whose ``event``
is "config", "train" (``step``, ``loss``, ``samples_per_s``), "eval" (``step``, ``auc``,
``logloss``), "final" (``steps``, ``auc``, ...) and, for a resumed run, "resume" (``step``). Three
panels share the step axis: training loss, AUC (every evaluation, the final one included) and
samples/s; each run is one line, labelled by its file name or by ``labels``.

A resumed run appends to the same file: the records after the checkpoint it resumed from were
computed again, so a "resume" record drops the earlier records past its step.

Drawn with matplotlib's Agg canvas (no display, no pyplot state), so it runs on a headless machine
and inside a library call alike.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os

from .errors import ConfigError, InputError

__all__ = ["Run", "read_metrics", "plot_runs"]


@dataclasses.dataclass
class Run:
    """One run's curves. train: [(step, loss, samples_per_s)]; eval: [(step, auc, logloss)]."""

    path: str
    label: str
    train: list
    eval: list


def _number(value) -> float:
    """A record's number as a float (NaN for null / non-numbers: a gap in the curve)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return math.nan
    return float(value)


def read_metrics(path, label: str | None = None) -> Run:
    """Parse a metrics file into a ``Run``.

    InputError naming the file (and the line) when it is missing, unreadable, not JSON lines, or
    holds no "train" record."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise InputError(f"{path} is a folder: pass the metrics file in it (one-embedding train "
                         f"--metrics FILE writes one)")
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        raise InputError(f"{path}: no such metrics file; check the path") from None
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: cannot be read as a text metrics file ({e})") from e
    train: list = []
    evals: list = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            raise InputError(f"{path}:{number}: not a JSON line ({e}): {line[:80]!r}; pass the "
                             f"file that one-embedding train --metrics wrote") from None
        if not isinstance(record, dict):
            raise InputError(f"{path}:{number}: a JSON line but not an object: {line[:80]!r}; "
                             f"metrics files hold one record ({{\"event\": ...}}) per line")
        event = record.get("event")
        step = _number(record.get("step"))
        if event == "train":
            train.append((step, _number(record.get("loss")), _number(record.get("samples_per_s"))))
        elif event == "eval":
            evals.append((step, _number(record.get("auc")), _number(record.get("logloss"))))
        elif event == "final":
            evals.append((_number(record.get("steps")), _number(record.get("auc")),
                          _number(record.get("logloss"))))
        elif event == "resume" and math.isfinite(step):
            # the steps after the checkpoint were trained again: keep only the new records
            train = [r for r in train if r[0] <= step]
            evals = [r for r in evals if r[0] <= step]
    if not train:
        raise InputError(f"{path}: no \"train\" records, nothing to plot; is it the file "
                         f"one-embedding train --metrics wrote (a run of at least one step)?")
    if label is None:
        label = os.path.basename(path)
    return Run(path, label, train, evals)


def _default_labels(paths: list[str]) -> list[str]:
    """File names, or parent/name where two runs share a file name (run1/m.jsonl, run2/m.jsonl)."""
    names = [os.path.basename(p) for p in paths]
    if len(set(names)) == len(names):
        return names
    return [os.path.join(os.path.basename(os.path.dirname(os.path.abspath(p))), n)
            for p, n in zip(paths, names)]


#: the first bytes of every PNG file: an existing --out that starts otherwise is not replaced
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
#: suffixes of other image formats: a PNG written under one of them would be misnamed
OTHER_IMAGE_SUFFIXES = {".jpg", ".jpeg", ".svg", ".pdf", ".gif", ".tif", ".tiff", ".webp",
                        ".eps", ".ps", ".bmp"}


def plot_runs(paths, out, labels=None) -> list[Run]:
    """Draw loss, AUC and samples/s against step for every metrics file in ``paths`` into the PNG
    ``out``; returns the runs read. labels: one per path (default: the file names).

    Every file is read (and checked) before anything is drawn; InputError / ConfigError name the
    file or option at fault."""
    paths = [os.fspath(p) for p in ([paths] if isinstance(paths, (str, os.PathLike)) else paths)]
    if not paths:
        raise ConfigError("no metrics files: pass one or more files that one-embedding train "
                          "--metrics wrote")
    if labels is not None and len(labels) != len(paths):
        raise ConfigError(f"--labels gives {len(labels)} label(s) for {len(paths)} file(s): give "
                          f"one per file, in the same order")
    out = os.fspath(out)
    folder = os.path.dirname(os.path.abspath(out))
    if os.path.isdir(out):
        raise ConfigError(f"--out {out!r} is a folder: name the image, e.g. "
                          f"{os.path.join(out, 'curves.png')}")
    if not os.path.isdir(folder):
        raise ConfigError(f"--out {out!r}: its folder {folder!r} does not exist; create it first")
    if os.path.splitext(out)[1].lower() in OTHER_IMAGE_SUFFIXES:
        raise ConfigError(f"--out {out!r}: plot writes PNG; name the file .png")
    if os.path.exists(out):
        if any(os.path.exists(p) and os.path.samefile(p, out) for p in paths):
            raise ConfigError(f"--out {out!r} is also one of the metrics files: name the image, "
                              "e.g. --out curves.png")
        with open(out, "rb") as f:
            if f.read(8) != PNG_SIGNATURE:
                raise ConfigError(f"--out {out!r} exists and is not a PNG image: name a new "
                                  "file (an earlier plot's PNG is replaced)")
    labels = list(labels) if labels is not None else _default_labels(paths)
    runs = [read_metrics(p, label) for p, label in zip(paths, labels)]

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 4.5))
    FigureCanvasAgg(fig)
    loss_ax, auc_ax, speed_ax = fig.subplots(1, 3)
    for i, run in enumerate(runs):
        color = f"C{i % 10}"
        steps = [r[0] for r in run.train]
        loss_ax.plot(steps, [r[1] for r in run.train], color=color, label=run.label, lw=1.2)
        speed_ax.plot(steps, [r[2] for r in run.train], color=color, label=run.label, lw=1.2)
        if run.eval:
            evals = sorted(run.eval)
            auc_ax.plot([r[0] for r in evals], [r[1] for r in evals], color=color,
                        label=run.label, marker="o", ms=4, lw=1.2)
    if not any(run.eval for run in runs):
        auc_ax.text(0.5, 0.5, "no evaluation records", ha="center", va="center",
                    transform=auc_ax.transAxes, color="gray")
    for ax, title, ylabel in ((loss_ax, "training loss", "loss (BCE)"),
                              (auc_ax, "evaluation AUC", "AUC"),
                              (speed_ax, "throughput", "samples/s")):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize="small")
    fig.tight_layout()
    try:
        fig.savefig(out, format="png", dpi=100)
    except OSError as e:
        raise InputError(f"--out {out!r} cannot be written ({e})") from e
    return runs
