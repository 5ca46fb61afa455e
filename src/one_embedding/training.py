"""The training behind ``one-embedding train`` and ``bench``: a ``TrainConfig`` -> ``Trainer``.

One step (``Trainer.train_step``): the batch's rows (prepared ahead by the ``Prefetcher``) ->
dense forward -> BCE with logits -> backward -> one ``Optimizer.step()`` for the dense parameters
(all-reduced over the ranks first) and the embedding rows -> the LR schedule advances.
Samples/s counts training steps only (evaluation and snapshots are excluded); the final record's
``samples_per_s`` is the steady state, leaving out the first 10% of steps (kernel loading, first
touches of memory), and ``samples_per_s_all`` counts every step.

Ranks (``mpiexec -n P``): ``batch_size`` is the global batch. Every rank reads the same stream of
global batches and keeps its block of rows (rank r: rows ``r*B/P .. (r+1)*B/P``), so global batch
k holds the same rows for any P. Each rank's loss gradient is its share of the global mean;
evaluation gathers every rank's predictions, so AUC covers the whole evaluation set. Only rank 0
(``is_chief``) writes metrics and the progress bar.

``--device cuda``: the model, the loss and the embedding run on the GPU (CuPy, fused kernels):
the embedding is built with ``device="cuda"`` (ids, rows, gradients and row updates in device
memory, the store's "device" tiers on the GPU), and the prefetch thread works on a CUDA stream of
its own. Rank r of several uses GPU ``r % local ranks``.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import sys
import time
from dataclasses import asdict, replace
from typing import Iterator

import numpy as np

from .cuda_graph import StepGraph
from .kernels.layout_ops import InteractionInput
from .config import MODELS, OPTIMIZERS, STORES, TrainConfig, make_row_optimizer
from .backend import embedding_device
from .errors import ConfigError
from .interrupts import CtrlC, interrupt_of, iterating
from . import host_sync
from .nn import amp
from .optim.loss_scale import LossScaler
from .resume_config import resumed_config
from .checkpoint import (
    TrainingInterrupted,
    check_set_idle,
    checkpoints,
    final_of_any_world,
    why_no_checkpoint,
    load_checkpoint,
    newest_checkpoint,
    prune_checkpoints,
    remove_snapshots,
    resumable_checkpoint,
    save_checkpoint,
    saved_config,
    snapshots_under,
)
from .data.features import FeatureTransform
from .shard import rank_path
from .optimizer import Optimizer
from .parallel.comm import local_gpu, training_comm
from .pipeline import Prefetcher
from .training_progress import (TIER_COUNTS, MetricsWriter, TrainProgress, progress_postfix,
                                run_counts)
from .training_setup import (
    build_model,
    check_same_config,
    device_namespace,
    evaluate,
    make_loaders,
    make_lr_schedule,
    rank_block,
    share_cores,
    store_options_for,
)

__all__ = ["TrainConfig", "Trainer", "TrainingInterrupted", "train", "evaluate", "MODELS",
           "OPTIMIZERS", "STORES"]

#: a "train" record every this many steps (and after the first)
TRAIN_RECORD_EVERY = 10  # the default of --log-interval


#: the feature lifecycle's counters in the final record, summed over the ranks
LIFECYCLE_FIELDS = ("admitted_rows", "not_admitted_lookups", "evicted_rows")

class Trainer:
    """Loaders, model, optimizer, LR schedule and metrics writer built from one config.

        >>> final = Trainer(TrainConfig(steps=5, batch_size=256, synthetic_rows=20_000),
        ...                 metrics_path=os.devnull, progress=False).run()
        >>> final["steps"], final["samples"]
        (5, 1280)
    """

    def __init__(self, cfg: TrainConfig, metrics_path: str | None = None, progress: bool = True,
                 metrics_stdout: bool | None = None):
        if not isinstance(cfg, TrainConfig):
            raise ConfigError(f"cfg is a {type(cfg).__name__}; pass a TrainConfig(...)")
        if cfg.snapshot_interval and not cfg.persistent_path:
            raise ConfigError(f"snapshot_interval={cfg.snapshot_interval} (--snapshot-interval) "
                              "writes checkpoints into the run's folder, and there is none: add "
                              "--persistent-path DIR or drop --snapshot-interval")
        self.cfg = cfg
        self.xp = device_namespace(cfg.device)      # no GPU for --device cuda: refused here
        self.comm = training_comm(cfg.comm, self.xp is not np)
        check_same_config(cfg, self.comm)
        if cfg.batch_size % self.comm.world:
            raise ConfigError(f"batch_size={cfg.batch_size} (--batch-size, the global batch) does "
                              f"not split into {self.comm.world} equal rank blocks: use a "
                              f"multiple of {self.comm.world}")
        if self.xp is not np:
            # one GPU per rank on a machine; everything below is built on it
            self.xp.cuda.Device(local_gpu(self.comm)).use()
        resume_from = self._claim_path()
        cfg = self.cfg  # settings left unset are now resolved (a new run's or the checkpoint's)
        row_optimizer = make_row_optimizer(cfg)
        self.train_loader, self.eval_loader, num_tables, total_keys = make_loaders(cfg)
        store = store_options_for(cfg, row_optimizer.required_size_factor(), total_keys)
        with embedding_device(cfg.device):
            self.model = build_model(cfg, num_tables, store, self.comm).to(self.xp)
        self.embedding = self.model.embedding
        self.embedding.exchange_dtype = cfg.exchange_dtype
        # fp16 AMP underflows small gradients without a loss scale (PyTorch's GradScaler rule)
        self.optimizer = Optimizer(row_optimizer, embeddings=[self.embedding],
                                   parameters=list(self.model.parameters()), comm=self.comm,
                                   loss_scale=LossScaler() if cfg.amp == "fp16" else None)
        self.lr_schedule = make_lr_schedule(cfg, self.optimizer)
        # the device path's checks, read with the losses (None on the CPU: checks read at once)
        self.checks = host_sync.DeferredChecks() if self.xp is not np else None
        self._layout = None   # DLRM's interaction-input layout of the step running (dense_step)
        self.step_graph = self._make_step_graph()
        self.progress = TrainProgress()
        # steps left out of the steady-state samples/s
        self.skip_steps = max(1, cfg.steps // 10) if cfg.steps else 0
        self.resumed_from = None
        self._tier_counts_before: list = []   # a resumed run's tier counts at its checkpoint
        if resume_from is not None:
            self._restore(resume_from)
        self.is_chief = self.comm.rank == 0  # rank 0 alone writes metrics and the progress bar
        self.show_progress = progress and self.is_chief
        self.writer = MetricsWriter(metrics_path, metrics_stdout) if self.is_chief else None

    # --- one step ----------------------------------------------------------------------------

    def train_step(self, batch, state=None):
        """Forward, loss, backward, one update of the dense weights and the embedding rows.

        batch: this rank's block of a global batch: dense (b, 13) float32, ids (b, F) int64,
        labels (b,); state: the ``StepState`` of ``embedding.prepare(batch.ids)`` (prepared now
        when None). Returns the mean loss over this rank's block: a 0-d array of the model's
        backend, left on the device (``read_losses`` reads it, averaged over the ranks)."""
        phases, clock = self.progress.phase_seconds, time.perf_counter
        t0 = clock()
        if state is None:
            state = self.embedding.prepare(batch.ids)
        # (b, F, E), or on the device DLRM's interaction input, the rows gathered straight into it
        embedded = self.model.embed(state, self.cfg.amp, self.xp)
        t1 = clock()
        dense, labels = self.xp.asarray(batch.dense), self.xp.asarray(batch.labels)
        scaler = self.optimizer.loss_scaler
        # a graph's inputs are arrays: DLRM's interaction input goes in as its buffer, and its
        # layout (precision, first slot), which dense_step puts back around it, into the key
        self._layout = None
        if isinstance(embedded, InteractionInput):
            self._layout, embedded = replace(embedded, data=None), embedded.data
        if self.step_graph is None:
            loss, grad = self.dense_step(dense, labels, embedded)
        else:  # the loss scale reaches the captured kernels: a new scale, a new capture
            layout = None if self._layout is None else (self._layout.precision,
                                                        self._layout.first_slot)
            loss, grad = self.step_graph(dense, labels, embedded, key=(
                self.cfg.amp, None if scaler is None else float(scaler.scale), layout))
            # the next replay overwrites the graph's loss, which is read steps later
            loss = self.xp.array(loss, copy=True)
        t2 = clock()
        if scaler is not None:  # a non-finite gradient marks the step as overflowed instead
            scaler.backward(self.embedding, grad)
        else:
            self.embedding.backward(grad)
        t3 = clock()
        self.optimizer.step()  # dense grads all-reduced over the ranks first
        self.optimizer.zero_grad()
        self.lr_schedule.step()
        t4 = clock()
        phases["embedding"] += (t1 - t0) + (t3 - t2)
        phases["dense"] += t2 - t1
        phases["update"] += t4 - t3
        return loss

    def dense_step(self, dense, labels, embedded):
        """The step's fixed-shape part: dense forward, loss, backward to the embeddings (dense
        grads accumulate in place); what ``step_graph`` captures and replays on a GPU.

        dense (b, 13) float32, labels (b,), embedded (b, F, E) float32, or the data of DLRM's
        interaction input whose layout ``train_step`` set aside -> (loss: 0-d mean over this
        rank's block, the embeddings' gradient (b, F, E) float32)."""
        scaler = self.optimizer.loss_scaler
        if self._layout is not None:
            embedded = replace(self._layout, data=embedded)
        with amp.autocast(self.cfg.amp):
            logits = self.model.forward_from_embeddings(dense, embedded)  # (b,)
            # the gradient of this rank's share of the global mean, times the loss scale
            # (unscaled by Optimizer.step, which skips an overflowed step); on the device the
            # loss is fused with the last layer's backward
            loss, _, dembedded = self.model.loss_and_backward_to_embeddings(
                logits, labels, share=labels.shape[0] / self.cfg.batch_size
                if self.comm.world > 1 else 1.0,
                loss_scale=1.0 if scaler is None else scaler.scale, fused=self.xp is not np)
        return loss, dembedded.astype(np.float32, copy=False)

    def _make_step_graph(self) -> StepGraph | None:
        """The CUDA graph of ``dense_step`` on the device path (None on the CPU); it runs
        uncaptured with --no-cuda-graph, and with dropout, whose mask changes each step through
        a host counter that a replay would keep at its captured value."""
        if self.xp is np:
            return None
        cfg = self.cfg
        self.graph_off_reason = None
        if not cfg.cuda_graph:
            self.graph_off_reason = "--no-cuda-graph"
        elif cfg.dropout > 0 and cfg.model in ("dcn", "deepfm"):
            self.graph_off_reason = ("dropout: each step's mask comes from a host counter that "
                                     "a replay would keep at its captured value")
        params = list(self.model.parameters())
        return StepGraph(self.dense_step, self.xp, name="the dense step",
                         persistent=lambda: [p.data for p in params] + [p.grad for p in params],
                         enabled=self.graph_off_reason is None)

    def cuda_graph_status(self) -> str | None:
        """How the dense step runs on the device path (None on the CPU): "replaying",
        "warming up", "uncaptured" (the last step's shapes were not the graph's), "off: <why>",
        "failed: <why>"."""
        if self.step_graph is None:
            return None
        if self.graph_off_reason is not None:
            return f"off: {self.graph_off_reason}"
        return self.step_graph.status

    def batches(self) -> Iterator:
        """This rank's block of each global training batch, epoch after epoch, until ``steps``
        (checked by ``run``) or ``epochs`` run out."""
        for _, batch in self.epoch_batches():
            yield batch

    def epoch_batches(self) -> Iterator:
        """(epoch, batch) pairs of ``batches``, from where ``progress`` stands (a resumed run
        starts in the middle of an epoch)."""
        cfg = self.cfg
        first, start = self.progress.epoch, self.progress.batches_in_epoch
        epochs = itertools.count(first) if cfg.steps is not None else range(first, cfg.epochs)
        feed = self.device_feed()
        for epoch in epochs:
            self.train_loader.set_epoch(epoch, start_batch=start if epoch == first else 0)
            produced = 0
            with iterating(feed) as epoch_feed:  # closed with this generator (``source``)
                for batch in epoch_feed:
                    produced += 1
                    yield epoch, rank_block(batch, self.comm.rank, self.comm.world)
            if cfg.steps is not None and produced == 0 and (epoch != first or start == 0):
                # with --steps the epochs repeat: an empty one would loop for ever
                skipped = self.train_loader.skipped
                raise ConfigError(
                    f"the training split produced no full batch of {cfg.batch_size:,} rows: its "
                    "data holds fewer rows than that"
                    + (f" ({skipped:,} malformed lines were skipped)" if skipped else "")
                    + ": check --data (an empty file?), or lower --batch-size")

    def device_feed(self):
        """What the training batches are read from: on a GPU, synthetic rows generated on the
        device (the loader's own batches, bit for bit) or file batches staged through
        page-locked buffers on their own stream; on the CPU the loader itself."""
        if self.xp is np:
            return self.train_loader
        from .data.device import DeviceBatches, DeviceSyntheticLoader

        if self.cfg.data == ("synthetic",):
            return DeviceSyntheticLoader(self.train_loader)
        return DeviceBatches(self.train_loader)

    # --- between steps -----------------------------------------------------------------------

    def evaluate(self) -> dict:
        """{"auc", "logloss", "eval_samples"} over ``eval_batches`` batches of the eval split."""
        with amp.autocast(self.cfg.amp):
            return evaluate(self.model, self.eval_loader, self.cfg.eval_batches, self.comm)

    def maybe_evaluate(self, step: int) -> None:
        if self.cfg.eval_interval and step % self.cfg.eval_interval == 0:
            record = {"event": "eval", "step": step, **self.evaluate()}
            self.write(record)

    def maybe_snapshot(self, step: int) -> None:
        """Checkpoint ``step-N`` every ``snapshot_interval`` steps (which needs a path), then
        drop the interval checkpoints beyond the ``keep_snapshots`` newest."""
        if self.cfg.snapshot_interval and step % self.cfg.snapshot_interval == 0 \
                and self.cfg.persistent_path:
            self.save_checkpoint(f"step-{step}")
            # every rank has published step-N (save ends in a barrier): older ones may go
            prune_checkpoints(self.embedding, self.cfg.keep_snapshots)

    # --- checkpoints -------------------------------------------------------------------------

    def save_checkpoint(self, name: str) -> None:
        """The embedding's rows and everything the run needs to continue bit-identically."""
        p = self.progress
        # the per-step losses go binary beside the model's arrays: as JSON they made each
        # checkpoint grow with the run (18 MB and 5 s a save at a million steps)
        progress = {k: v for k, v in asdict(p).items() if k != "losses"}
        state = {"step": p.step, "epoch": p.epoch, "batches_in_epoch": p.batches_in_epoch,
                 "progress": progress, "world_size": self.comm.world,
                 "train_loader": self._loader_state(),
                 # this rank's exchange bytes so far: a resumed run's totals go on from them
                 "traffic": asdict(self.embedding.traffic),
                 # and its tiers' hits, misses, evictions, writes and copies
                 "tier_counts": [{k: s[k] for k in ("tier", *TIER_COUNTS) if k in s}
                                 for s in self.run_store_stats()],
                 # raw features -> model inputs, for serving (one_embedding.serving)
                 "features": FeatureTransform.for_config(self.cfg).as_dict()}
        save_checkpoint(name, self.embedding, model=self.model, optimizer=self.optimizer,
                        lr_schedule=self.lr_schedule, state=state, config=asdict(self.cfg),
                        state_arrays={"losses": np.asarray(p.losses, np.float64)})

    def _loader_state(self):
        state_dict = getattr(self.train_loader, "state_dict", None)
        return state_dict() if state_dict else None

    def _claim_path(self) -> str | None:
        """Before anything is built: refuse a path that holds another run's checkpoints unless
        told to resume (-> the checkpoint to resume from) or to overwrite (-> deleted)."""
        cfg = self.cfg
        existing = snapshots_under(cfg.persistent_path) if cfg.persistent_path else []
        if cfg.resume:
            newest = newest_checkpoint(cfg.persistent_path, self.comm.rank, self.comm.world,
                                       self.comm)
            if newest is None:
                raise ConfigError(f"--resume: persistent_path {cfg.persistent_path!r} holds no "
                                  f"complete checkpoint: {why_no_checkpoint(cfg.persistent_path)}")
            name, saved_by = newest
            if saved_by != self.comm.world:
                check_set_idle(cfg.persistent_path, saved_by, self.comm)
            saved = saved_config(cfg.persistent_path, name, saved_by)
            cfg = self.cfg = resumed_config(cfg, saved, name)
            return newest
        cfg = self.cfg = cfg.with_model_defaults().resolved()  # a new run: the model's optimizer
        if cfg.ftrl_convention is None:  # a new run: OneFlow's formula
            self.cfg = replace(cfg, ftrl_convention="oneflow")
        if existing:
            if not cfg.overwrite:
                raise ConfigError(
                    f"persistent_path {cfg.persistent_path!r} already holds a run's snapshots "
                    f"({', '.join(existing[:4])}{', ...' if len(existing) > 4 else ''}): add "
                    "--resume to continue it, or --overwrite to delete them and start over")
            if self.comm.rank == 0:
                remove_snapshots(cfg.persistent_path)
            self.comm.barrier()
        return None

    def _restore(self, newest: tuple[str, int]) -> None:
        """Load checkpoint (name, saved by that many ranks): rows, dense weights and optimizer
        state, LR schedule, dropout counters, progress, data position."""
        name, saved_by = newest
        record = load_checkpoint(name, self.embedding, model=self.model, optimizer=self.optimizer,
                                 lr_schedule=self.lr_schedule, world=saved_by)
        state = record["state"]
        saved = state["progress"]
        # the losses are binary (older checkpoints: a JSON list in the progress)
        losses = record.get("state_arrays", {}).get("losses")
        self.progress = TrainProgress(**{**saved, "phase_seconds": dict(saved["phase_seconds"]),
                                         "losses": saved.get("losses") if losses is None
                                         else losses.tolist()})
        loader = state.get("train_loader")
        if loader is not None and hasattr(self.train_loader, "load_state_dict"):
            self.train_loader.load_state_dict(loader)
        self.resumed_from = {"checkpoint": name, "step": state["step"]}
        if state.get("world_size") == self.comm.world:  # another world's traffic is not ours
            for field, count in (state.get("traffic") or {}).items():
                setattr(self.embedding.traffic, field, int(count))
            self._tier_counts_before = state.get("tier_counts") or []

    def write(self, record: dict) -> None:
        if self.writer is not None:
            self.writer.write(record)

    # --- the whole run -----------------------------------------------------------------------

    def run(self) -> dict:
        """Train as configured, evaluate, snapshot; returns the final record (also written).
        Ctrl-C raises ``TrainingInterrupted``, naming the checkpoint a resume continues from
        (one that a compiled extension lost is raised at the next step: ``interrupts``)."""
        # the run's BLAS threads, given back when it ends (a program goes on with its own)
        with CtrlC() as ctrl_c, share_cores(self.comm.local_size, self.cfg.blas_threads):
            try:
                return self._run(ctrl_c)
            except BaseException as e:
                # a run that ends in an error or an interrupt releases its store (the path's
                # lock) and threads too: a resume in this process (a notebook, where the last
                # error keeps this Trainer alive) found the path locked by nobody it could reach
                self.close()
                if isinstance(e, TrainingInterrupted) or interrupt_of(e) is None:
                    raise
                # the disk says what is saved: an interrupted save published nothing, and a
                # finished one may have pruned older checkpoints already
                path = self.cfg.persistent_path
                saved = resumable_checkpoint(path, self.comm.world) if path else None
                raise TrainingInterrupted(self.progress.step, path, saved) from e

    def _run(self, ctrl_c: CtrlC) -> dict:
        cfg, progress = self.cfg, self.progress
        done = cfg.steps is not None and progress.step >= cfg.steps
        if done and self._finished():
            raise ConfigError(f"the run is already at step {progress.step} "
                              f"({self.resumed_from['checkpoint']!r}) and --steps is {cfg.steps}: "
                              "--steps counts the whole run; raise it to train further")
        self.write({"event": "config", **asdict(cfg)})
        if self.resumed_from is not None:
            self.write({"event": "resume", **self.resumed_from})
        if done:  # killed after its last interval checkpoint: only the end is left to do
            record = self.finish()
            self.write(record)
            self.close()
            return record
        bar = None
        if self.show_progress:
            from tqdm import tqdm

            bar = tqdm(total=cfg.steps, initial=progress.step, unit="step", file=sys.stderr,
                       dynamic_ncols=True)
        source = batches = self.epoch_batches()
        if cfg.steps is not None:   # the prefetch thread prepares no batch past the last step
            batches = itertools.islice(batches, max(0, cfg.steps - progress.step))
        prefetcher = Prefetcher(batches, self.embedding, depth=cfg.prefetch_depth,
                                ids=lambda item: item[1].ids)
        self._logged_step = progress.step   # the last step a train record was written for
        pending: list = []  # losses of the steps since the last read, still on the device
        # on the device the step's checks (inputs, labels) stay there until the losses are read
        checks = host_sync.deferring(self.checks) if self.checks is not None \
            else contextlib.nullcontext()
        try:
            with prefetcher, checks:
                t0 = time.perf_counter()
                wait = t0
                for (epoch, batch), state in prefetcher:
                    # a lookup made inside the iteration (depth 0) is embedding work, not wait
                    looked_up, prefetcher.inline_prepare_seconds = \
                        prefetcher.inline_prepare_seconds, 0.0
                    progress.phase_seconds["wait"] += time.perf_counter() - wait - looked_up
                    progress.phase_seconds["embedding"] += looked_up
                    ctrl_c.check()
                    if self.checks is not None:
                        self.checks.step = progress.step + 1
                    loss = self.train_step(batch, state)
                    pending.append(loss)  # read (and averaged over the ranks) every few steps
                    progress.count(epoch, cfg.batch_size, None,
                                   time.perf_counter() - t0, self.skip_steps)
                    step = progress.step
                    last = cfg.steps is not None and step >= cfg.steps
                    if bar is not None:
                        bar.update(1)
                    if step % cfg.log_interval == 0 or step == 1 or last or \
                            self._reads_progress(step):
                        self.read_losses(pending)
                        if bar is not None:
                            bar.set_postfix_str(progress_postfix(progress))
                    if step % cfg.log_interval == 0 or step == 1 or last:
                        self.write_train_record()
                    self.maybe_evaluate(step)
                    self.maybe_snapshot(step)
                    if cfg.steps is not None and step >= cfg.steps:
                        break
                    t0 = wait = time.perf_counter()
        finally:
            if bar is not None:
                bar.close()
            # the loader's read-ahead thread stops here, where a Ctrl-C is raised, not when
            # the generator is collected (a Ctrl-C there is printed as ignored and lost); after
            # an error or an interrupt too, so that no thread outlives the run
            source.close()
        ctrl_c.check()
        self.read_losses(pending)  # the loader ran out before --steps
        if progress.step > self._logged_step:   # an epoch run's last step: its record too
            self.write_train_record()
        record = self.finish()
        self.write(record)
        self.close()
        return record

    def write_train_record(self) -> None:
        """The ``train`` record of the step just run (its losses read already)."""
        progress = self.progress
        graph = self.cuda_graph_status()
        self.write({"event": "train", "step": progress.step, "loss": progress.losses[-1],
                    "samples_per_s": progress.samples / progress.train_seconds,
                    **({"cuda_graph": graph} if graph is not None else {})})
        self._logged_step = progress.step

    def _reads_progress(self, step: int) -> bool:
        """Whether ``step`` evaluates or checkpoints (both need the losses on the host)."""
        cfg = self.cfg
        return bool(cfg.eval_interval and step % cfg.eval_interval == 0) or \
            bool(cfg.snapshot_interval and step % cfg.snapshot_interval == 0)

    def read_losses(self, pending: list) -> None:
        """Append the device losses in ``pending`` to ``progress.losses`` with one read (they
        are stacked first, with the flags of the checks deferred since the last read: a failed
        one raises, naming its step), and empty ``pending``."""
        if self.checks is not None:
            losses = self.checks.read(self.xp, pending, "losses")
        elif pending:
            losses = host_sync.to_host(self.xp.stack([self.xp.asarray(x) for x in pending]),
                                       "losses")
        else:
            return
        if self.comm.world > 1:  # each rank's mean over its block -> the global batch's mean
            losses = self.comm.allreduce_sum(np.asarray(losses, np.float64)) / self.comm.world
        self.progress.losses.extend(float(x) for x in losses)
        pending.clear()

    def _finished(self) -> bool:
        """The run holds its final checkpoint (``--snapshot-name``) at the step it resumed from
        on every rank: nothing is left to do."""
        cfg = self.cfg
        if not cfg.persistent_path:
            return True
        folder = rank_path(cfg.persistent_path, self.comm.rank, self.comm.world, cfg.store)
        have = dict((n, s) for s, n in checkpoints(folder)) if os.path.isdir(folder) else {}
        mine = have.get(cfg.snapshot_name) == self.progress.step
        # or a set saved by another number of ranks holds it (the run finished there)
        mine = mine or final_of_any_world(cfg.persistent_path, cfg.snapshot_name,
                                          self.progress.step)
        return bool(self.comm.allreduce_sum(np.array([float(not mine)]))[0] == 0)

    def finish(self) -> dict:
        """Final evaluation and snapshot -> the final record."""
        cfg, p = self.cfg, self.progress
        final = self.evaluate()
        if cfg.persistent_path:
            self.save_checkpoint(cfg.snapshot_name)
        head = float(np.mean(p.losses[: max(1, len(p.losses) // 10)]))
        tail = float(np.mean(p.losses[-max(1, len(p.losses) // 10):]))
        stats = self.run_store_stats()
        scaler = self.optimizer.loss_scaler
        rows_stored = int(self.comm.allreduce_sum(np.array([len(self.embedding)], np.int64))[0])
        lifecycle = {k: int(v) for k, v in zip(LIFECYCLE_FIELDS, self.comm.allreduce_sum(
            np.array([stats[-1].get(k, 0) for k in LIFECYCLE_FIELDS], np.int64)))}
        top = stats[0]
        lookups = top["hits"] + top["misses"]
        return {
            "event": "final", "model": cfg.model, "optimizer": cfg.optimizer, "lr": cfg.lr,
            "store": cfg.store,
            "engine": cfg.engine if cfg.store == "cached_ssd" else None,
            "steps": p.step, "samples": p.samples, "train_seconds": p.train_seconds,
            "samples_per_s": (p.steady_samples / p.steady_seconds if p.steady_seconds
                              else p.samples / p.train_seconds if p.train_seconds else float("nan")),
            "samples_per_s_all": p.samples / p.train_seconds if p.train_seconds else float("nan"),
            "steady_after_steps": self.skip_steps if p.steady_seconds else 0,
            "loss_first_10pct": head, "loss_last_10pct": tail, **final,
            "top_tier_hit_rate": top["hits"] / lookups if lookups else float("nan"),
            "rows_stored": rows_stored, **lifecycle, "store_stats": stats,
            "skipped_lines": self.train_loader.skipped,
            "world_size": self.comm.world, "exchange_dtype": self.embedding.exchange_dtype,
            "exchange_bytes": self.embedding.traffic.exchange_bytes,
            "prefetch_depth": cfg.prefetch_depth, "amp": cfg.amp,
            **({"loss_scale": scaler.scale, "skipped_steps": scaler.skipped_steps}
               if scaler is not None else {}),
            "phase_seconds": dict(p.phase_seconds),
            **({"cuda_graph": self.cuda_graph_status(),
                "cuda_graph_replays": self.step_graph.stats.replays}
               if self.step_graph is not None else {}),
        }

    def run_store_stats(self) -> list[dict]:
        """The embedding's per-tier stats, their counts over the whole run (``run_counts``)."""
        return run_counts(self.embedding.store_stats(), self._tier_counts_before)

    def close(self) -> None:
        """Close the metrics file and the embedding (its store, the path's lock); twice is fine."""
        if self.writer is not None:
            self.writer.close()
        self.embedding.close()


def train(cfg: TrainConfig, metrics_path: str | None = None, progress: bool = True,
          metrics_stdout: bool | None = None) -> dict:
    """Run a training as configured; returns the final record (also written as JSON lines to
    ``metrics_path`` and, when ``metrics_stdout`` (default: when there is no path), stdout)."""
    return Trainer(cfg, metrics_path=metrics_path, progress=progress,
                   metrics_stdout=metrics_stdout).run()
