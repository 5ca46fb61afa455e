"""bench_gpu's dense-step parts: 5, the loss fused with the last layer (``bench_fused_loss``),
6, where the DLRM dense step's time goes, per stage and per precision, and 7, the optimizer's
dense update in one launch against one parameter at a time (``bench_dense_update``).

On an H200 (2026-11-27) the dense step alone (DLRM 512-256-128 / 1024-1024-512-256-1, batch
65,536, inputs on the device) took 25.9 ms with ``--amp off`` and 15.1 ms with ``bf16``, where
its products are some 0.96 TFLOP (fp32 without tensor cores about 14 ms at 67 TFLOP/s, bf16
about 1.4 ms at 700): so the bf16 step is not in its products. This part times, for ``--amp
off``, ``tf32`` and ``bf16``:

- each stage alone: the bottom MLP's forward, the interaction's, the top MLP's; and each stage's
  forward + backward (the backward is the difference: a backward needs its own forward);
- every matrix product of the two MLPs alone (forward ``x Wᵀ``, backward ``dh W`` and
  ``dhᵀ x``, at the layer shapes, through ``nn.amp.matmul`` as the layers call it), with their
  FLOP rate: the products' share of the step against the passes around them (casts, bias +
  ReLU, masks, the interaction);
- the whole step (forward + loss + backward) as the baseline the stages add up to; under bf16
  also with ``nn.linear.FUSED_BACKWARD_CAST`` off (each Linear backward's dh in fp32, cast by
  each of its two products: the path before the fused pass), and with
  ``nn.linear.HIDDEN_OUTPUTS_AS_BITS`` off (every hidden output, and the interaction's, also
  written, and kept, in fp32: the path before their 16-bit copies stood alone);
- the whole step replayed as the trainer's CUDA graph: the device's time alone (the uncaptured
  step also pays Python's launches, a few hundred a step);
- the whole step with ``kernels.cuda_module.LOADS_AHEAD`` off (the bias + ReLU (+ cast)
  kernels' loads one at a time, as before: the baseline of their loads ahead of the stores);
- under tf32 / bf16 the interaction's forward + backward again with
  ``dense_ops.BLOCKED_INTERACTION`` off (the ``_tile`` kernels, a shared load per product, as
  the baseline of the 16-byte-vector forward and the register-blocked backward).

Prints one table per precision; ``bench_gpu --skip dense`` leaves it out.
"""
from __future__ import annotations

import numpy as np

from .common import markdown_table


def _dense_setup(dev, args, rng):
    """Part 2's DLRM on the device and one batch of its dense inputs -> (embedding (closed by
    the caller; never looked up), model, dense (B, 13), embedded (B, 26, E), labels (B,))."""
    import one_embedding as oe
    from one_embedding.models import DLRM

    xp, b = dev.xp, args.batch_size
    tables = [oe.make_table_options(oe.make_uniform_initializer(-0.01, 0.01))] * 26
    emb = oe.MultiTableEmbedding("dense_only", args.dim, np.float32, np.int64, tables,
                                 oe.make_device_mem_store_options(None, capacity=1024),
                                 device="cpu")
    model = DLRM(num_tables=26, embedding_dim=args.dim, dense_features=13,
                 bottom_mlp=args.bottom_mlp, top_mlp=args.top_mlp, embedding=emb).to(xp)
    dense = xp.asarray(np.log1p(rng.exponential(20.0, (b, 13))).astype(np.float32))
    embedded = xp.asarray((rng.standard_normal((b, 26, args.dim)) * 0.05).astype(np.float32))
    labels = xp.asarray((rng.random(b) < 0.25).astype(np.float32))
    return emb, model, dense, embedded, labels


def _linear_shapes(mlp, batch: int):
    """(batch, in, out) of each Linear layer of ``mlp``."""
    return [(batch, layer.in_features, layer.out_features) for layer in mlp.layers]


def bench_dense_parts(dev, args) -> dict:
    """-> {"modes": {amp: {"rows": [...], "step_ms", "products_ms", "products_tflops"}}}."""
    from one_embedding.kernels import cuda_module as cm
    from one_embedding.kernels import dense_ops
    from one_embedding.nn import amp, linear

    xp = dev.xp
    b = args.batch_size
    rng = np.random.default_rng(6)
    emb, model, dense, embedded, labels = _dense_setup(dev, args, rng)
    shapes = _linear_shapes(model.bottom_mlp, b) + _linear_shapes(model.top_mlp, b)
    operands = [(xp.asarray(rng.standard_normal((m, k)).astype(np.float32)),
                 xp.asarray(rng.standard_normal((n, k)).astype(np.float32) * 0.05),
                 xp.asarray(rng.standard_normal((m, n)).astype(np.float32)))
                for m, k, n in shapes]
    product_flop = sum(3 * 2 * m * k * n for m, k, n in shapes)   # forward, dx, dW
    modes = {}
    for mode in ("off", "tf32", "bf16") if not dev.dry_run else ("off", "bf16"):
        def seconds(fn):
            def run():
                with amp.autocast(mode):
                    fn()
                model.zero_grad()
            return dev.seconds(run, args.repeats) * 1e3

        with amp.autocast(mode):
            z = model.bottom_mlp.forward(dense)
            inter = model.interaction.forward([z, embedded], z)
            logits = model.top_mlp.forward(inter)
        dz = xp.ones_like(z) * 1e-3
        dinter = xp.ones_like(inter) * 1e-3
        dlogits = xp.ones_like(logits) * 1e-3
        model.zero_grad()

        def bottom_both():
            model.bottom_mlp.forward(dense)
            model.bottom_mlp.backward(dz)

        def interaction_both():
            model.interaction.forward([z, embedded], z)
            model.interaction.backward(dinter)

        def top_both():
            model.top_mlp.forward(inter)
            model.top_mlp.backward(dlogits)

        def step():
            out = model.forward_from_embeddings(dense, embedded)
            model.loss_and_backward_to_embeddings(out, labels)

        def products():
            for x, w, dy in operands:
                amp.matmul(x, w.T, fp32_result=True)
                amp.matmul(dy.T, x, fp32_result=True)
                amp.matmul(dy, w)

        stages = [("bottom MLP", lambda: model.bottom_mlp.forward(dense), bottom_both),
                  ("interaction", lambda: model.interaction.forward([z, embedded], z),
                   interaction_both),
                  ("top MLP", lambda: model.top_mlp.forward(inter), top_both)]
        rows = []
        total = 0.0
        for name, forward, both in stages:
            fwd_ms, both_ms = seconds(forward), seconds(both)
            total += both_ms
            rows.append({"stage": name, "forward ms": fwd_ms, "backward ms": both_ms - fwd_ms,
                         "forward + backward ms": both_ms})
        if mode != "off":   # the interaction's kernels, blocked or the tile ones
            blocked_ms = next(r["forward + backward ms"] for r in rows
                              if r["stage"] == "interaction")
            tiled_ms = _switched_off(dense_ops, "BLOCKED_INTERACTION", seconds, interaction_both)
            rows.append({"stage": f"interaction, the _tile kernels (before): the vector "
                                  f"forward and blocked backward are {tiled_ms / blocked_ms:.2f}x",
                         "forward + backward ms": tiled_ms})
        step_ms, products_ms = seconds(step), seconds(products)
        tflops = product_flop / (products_ms / 1e3) / 1e12
        rows.append({"stage": "sum of the stages", "forward + backward ms": total})
        rows.append({"stage": "whole step (+ loss), the baseline", "forward + backward ms": step_ms})
        if mode in ("fp16", "bf16"):    # the Linear backward's cast of dh fused or not
            before_ms = _switched_off(linear, "FUSED_BACKWARD_CAST", seconds, step)
            rows.append({"stage": f"whole step, dh in fp32 and cast by each product (the path "
                                  f"before): the fused pass is {before_ms / step_ms:.2f}x",
                         "forward + backward ms": before_ms})
            fp32_hidden_ms = _switched_off(linear, "HIDDEN_OUTPUTS_AS_BITS", seconds, step)
            rows.append({"stage": f"whole step, hidden and interaction outputs also written in "
                                  f"fp32 (the path before): 16-bit copies alone are "
                                  f"{fp32_hidden_ms / step_ms:.2f}x",
                         "forward + backward ms": fp32_hidden_ms})
        graph_ms, graph_status = _captured_step_ms(dev, model, mode, dense, labels, embedded,
                                                   seconds)
        rows.append({"stage": f"whole step replayed as a CUDA graph (the CLI's way: the device's "
                              f"time without Python's launches; {graph_status}): "
                              f"{step_ms / graph_ms:.2f}x the uncaptured step",
                     "forward + backward ms": graph_ms})
        # the bias + ReLU kernels' loads one at a time
        one_at_a_time_ms = _switched_off(cm, "LOADS_AHEAD", seconds, step)
        rows.append({"stage": f"whole step, bias + ReLU loads one at a time (the kernels "
                              f"before): loads ahead are {one_at_a_time_ms / step_ms:.2f}x",
                     "forward + backward ms": one_at_a_time_ms})
        rows.append({"stage": f"the MLPs' {3 * len(shapes)} products alone ({tflops:.3g} TFLOP/s)",
                     "forward + backward ms": products_ms})
        modes[mode] = {"rows": rows, "step_ms": step_ms, "products_ms": products_ms,
                       "products_tflops": tflops, "products_share": products_ms / step_ms}
    emb.close()
    return {"modes": modes, "product_tflop": product_flop / 1e12}


def _switched_off(module, switch: str, seconds, fn) -> float:
    """``seconds(fn)`` with ``module.<switch>`` (a True-by-default path switch) False: the path
    before, timed as a baseline in the same run; the switch is True again afterwards."""
    setattr(module, switch, False)
    try:
        return seconds(fn)
    finally:
        setattr(module, switch, True)


def _captured_step_ms(dev, model, mode, dense, labels, embedded, seconds) -> tuple[float, str]:
    """ms per dense step (forward, loss, backward to the embeddings; the gradients zeroed after
    each, as ``seconds`` does) replayed as the trainer's CUDA graph (``cuda_graph.StepGraph``,
    the dense parameters as its persistent arrays, the deferred checks as the trainer defers
    them), warmed up and captured before the timing -> (ms, the graph's status)."""
    from one_embedding import host_sync
    from one_embedding.cuda_graph import StepGraph
    from one_embedding.nn import amp

    params = list(model.parameters())

    def dense_step(d, y, e):
        with amp.autocast(mode):
            out = model.forward_from_embeddings(d, e)
            loss, _, de = model.loss_and_backward_to_embeddings(out, y)
        return loss, de

    graph = StepGraph(dense_step, dev.xp, name="bench_gpu's dense step",
                      persistent=lambda: [p.data for p in params] + [p.grad for p in params])
    checks = host_sync.DeferredChecks()
    with host_sync.deferring(checks):
        for _ in range(graph.warmup + 2):        # the uncaptured calls, the capture, a replay
            graph(dense, labels, embedded)
            model.zero_grad()
        ms = seconds(lambda: graph(dense, labels, embedded))
    checks.read(dev.xp, reason="bench_gpu: the dense step's checks")
    return ms, graph.status


def print_dense_parts(result: dict, args) -> list[str]:
    """Prints the tables; -> the summary's phrases."""
    print(f"\n## where the dense step's time goes (DLRM, batch {args.batch_size}, {args.repeats} "
          f"timed calls each; the MLPs' products {result['product_tflop']:.2f} TFLOP a step)")
    summary = []
    for mode, r in result["modes"].items():
        print(f"\n--amp {mode}")
        print(markdown_table(r["rows"], ["stage", "forward ms", "backward ms",
                                         "forward + backward ms"]))
        summary.append(f"{mode} {r['step_ms']:.1f} ms ({r['products_share']:.0%} products at "
                       f"{r['products_tflops']:.3g} TFLOP/s)")
    return ["dense step " + ", ".join(summary)]


def bench_fused_loss(dev, args) -> dict:
    """Part 5: ms per dense step (and per loss + last-layer backward alone) with the loss fused
    with the last layer, against the unfused passes, on part 2's DLRM shapes."""
    from one_embedding.nn import BCEWithLogits, amp

    emb, model, dense, embedded, labels = _dense_setup(dev, args, np.random.default_rng(5))
    variants = [("fused", True), ("unfused", False)] if not dev.dry_run else [("unfused", False)]
    last = model.top_mlp.layers[-1]
    rows = []
    for mode in ("off", "bf16"):
        with amp.autocast(mode):
            logits = model.forward_from_embeddings(dense, embedded)
            x_last = last._x                                    # (B, top_mlp[-2]): its input
            model.loss_and_backward_to_embeddings(logits, labels, fused=False)
        model.zero_grad()
        timings = {}
        for name, fused in variants:
            def step(fused=fused):
                with amp.autocast(mode):
                    out = model.forward_from_embeddings(dense, embedded)
                    model.loss_and_backward_to_embeddings(out, labels, fused=fused)
                model.zero_grad()

            def loss_and_last(fused=fused):         # the logit layer's forward, then the rest
                with amp.autocast(mode):
                    z = last.forward(x_last).reshape(-1)
                    if fused:
                        last.loss_and_backward(z, labels)
                    else:
                        loss_fn = BCEWithLogits()
                        loss_fn(z, labels)
                        last.backward(loss_fn.backward().reshape(-1, 1))
                model.zero_grad()

            timings[name] = (dev.seconds(step, args.repeats) * 1e3,
                             dev.seconds(loss_and_last, args.repeats) * 1e3)
        base_step, base_part = timings["unfused"]
        for name, (step_ms, part_ms) in timings.items():
            rows.append({"what": f"dense step, --amp {mode}, {name}", "amp": mode, "fused": name,
                         "step ms": step_ms, "x unfused step": base_step / step_ms,
                         "loss + last layer ms": part_ms, "x unfused part": base_part / part_ms,
                         "samples_per_s": args.batch_size / (step_ms / 1e3)})
    emb.close()
    return {"rows": rows, "fused_step_speedup": {r["amp"]: r["x unfused step"] for r in rows
                                                 if r["fused"] == "fused"}}


def bench_dense_update(dev, args) -> dict:
    """Part 7: the optimizer's update of the DLRM's dense parameters (part 2's shapes), the
    group in one launch (``kernels.dense_update``: the flags, then ``optim_dense_<rule>``)
    against the per-parameter path it replaced on the device (``optimizer.masked_update``: the
    rule's CuPy array expressions and the all-zero select, per parameter), SGD and Adam, ms per
    update (host launches included, as an uncaptured step pays them) and whether both gave the
    same bits after the timed updates (a parameter with an all-zero gradient among them)."""
    from one_embedding import optim
    from one_embedding.kernels import dense_update, device_ops
    from one_embedding.nn.module import Parameter
    from one_embedding.optimizer import masked_update

    xp = dev.xp
    emb, model, *_ = _dense_setup(dev, args, np.random.default_rng(7))
    emb.close()
    rng = np.random.default_rng(8)
    shapes = [p.data.shape for p in model.parameters()]
    grads = [xp.asarray((rng.standard_normal(s) * 1e-3).astype(np.float32)) for s in shapes]
    grads[1][...] = 0                                            # a bias without gradient
    try:       # a dry run without the emulator (tests/gpu_dry_run.py) has no launcher
        launch = device_ops.cupy_launcher()
    except ImportError:
        launch = None
    paths = ("per parameter", "one launch") if launch is not None else ("per parameter",)
    rows, same = [], {}
    for name, make in (("sgd", lambda: optim.SGD(lr=0.1)),
                       ("adam", lambda: optim.Adam(lr=0.01, weight_decay=0.01))):
        copies = {}
        for path in paths:
            opt = make()
            params = [Parameter(xp.array(p.data), p.name) for p in model.parameters()]
            states = [[xp.full_like(p.data, v) for v in opt.initial_state()] for p in params]
            for p, g in zip(params, grads):
                p.grad[...] = g
            step = [0]
            if path == "one launch":
                flat = dense_update.FlatDense(params, states, opt.n_states, launch)

                def update(flat=flat, opt=opt, step=step):
                    step[0] += 1
                    flat.find_nonzero()
                    flat.update(opt, step[0])
            else:
                def update(params=params, states=states, opt=opt, step=step):
                    step[0] += 1
                    for p, own in zip(params, states):
                        masked_update(opt, p.data, own, p.grad, step[0])
            ms = dev.seconds(update, args.repeats) * 1e3
            host = (lambda a: np.asarray(a)) if dev.dry_run else dev.xp.asnumpy
            copies[path] = (step[0], [host(p.data) for p in params]
                            + [host(s) for own in states for s in own])
            rows.append({"what": f"{name}: {path}", "ms": ms})
        if "one launch" in copies:
            (n1, a), (n2, b) = copies["per parameter"], copies["one launch"]
            same[name] = n1 == n2 and all(np.array_equal(x.view(np.uint32), y.view(np.uint32))
                                          for x, y in zip(a, b))
        base = next(r["ms"] for r in rows if r["what"] == f"{name}: per parameter")
        for r in rows:
            if r["what"].startswith(name):
                r["x per parameter"] = base / r["ms"]
    return {"rows": rows, "same_bits": same, "parameters": len(shapes),
            "elements": int(sum(int(np.prod(s)) for s in shapes)),
            "speedup": {r["what"].split(":")[0]: r["x per parameter"] for r in rows
                        if r["what"].endswith("one launch")}}


def print_dense_update(result: dict) -> list[str]:
    """Prints part 7's table; -> the summary's phrases."""
    print(f"\n## the dense update: {result['parameters']} parameters ({result['elements']:,} "
          "floats), the group in one launch against one parameter at a time")
    print(markdown_table(result["rows"], ["what", "ms", "x per parameter"]))
    if not result["speedup"]:
        return []
    return ["dense update: one launch " + ", ".join(
        f"{x:.1f}x per parameter ({rule}; same bits: {result['same_bits'][rule]})"
        for rule, x in result["speedup"].items())]
