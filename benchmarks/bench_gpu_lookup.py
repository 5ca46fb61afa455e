"""bench_gpu's part 1: the embedding lookup's bandwidth against the device's copy bandwidth, and
the parts it is made of, each beside its baseline measured in the same run.

- ``bench_lookup``: ``emb(ids)`` of a device_mem table against a device-to-device copy of the
  output's size; on the device path its parts (hash-table unique against the sort-based one it
  replaced, the chain's find (its line copies at 16 bytes per lane where the layout allows it)
  beside the same find with one-element copies, the gather by inverse as the step runs it
  beside the scalar kernel), then the two below.
- ``bench_dedup_find``: the dedup and the store's find as two kernels against the find fused
  into the dedup's output pass, results compared bit for bit, and ``emb(ids)`` with the fusion
  switched the other way.
- ``bench_grad_update``: the per-key gradient sum + Adam row update as two kernels against the
  fused one, results compared bit for bit; the fused one also with the row update's one-element
  accesses (``device_ops.VECTOR_ROW_UPDATES`` off) as the baseline of its 16-byte path.
- ``bench_interaction_input``: a batch's rows into the dot interaction's input, gather +
  concatenation against the gather straight into it, fp32 and bf16.

``print_lookup`` prints the lookup's table and comparisons and gives ``bench_gpu`` their summary
lines; ``bench_gpu``'s module docstring says what each bandwidth counts and the goals.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .common import markdown_table, zipf_ids

#: issue 32's goal for the lookup: this share of the device's copy bandwidth
LOOKUP_GOAL = 0.8
#: FBGEMM's table-batched embedding lookups reach 76-83% of HBM bandwidth (the reference the
#: lookup's share of the copy bandwidth is printed beside)
FBGEMM_HBM_SHARE = (0.76, 0.83)
#: the lookup's gather parts: the step's (16 bytes per thread where the layout allows it) and the
#: scalar kernel as its baseline in the same run (issue 32 item 3)
GATHER_PART = "gather (rows by inverse, the step's: lines read in place)"
GATHER_SCALAR_PART = "gather, scalar kernel (baseline: gather_rows(vector=False))"
#: the chain's find, its line copies as the step runs them (16 bytes per lane where the layout
#: allows it), and with one-element copies as their baseline in the same run (issue 32 item 3)
FIND_PART = "find (chain.lookup of the unique keys)"
FIND_SCALAR_PART = "find, one-element line copies (baseline: VECTOR_LINE_COPIES off)"
#: the fused gradient sum + Adam update with the row update's one-element accesses: the baseline
#: of its 16-byte path in the same run (issue 32 item 3)
UPDATE_SCALAR_PART = ("grad sum + Adam update, fused, one-element line accesses "
                      "(baseline: VECTOR_ROW_UPDATES off)")

if TYPE_CHECKING:
    from .bench_gpu import Device


def bench_lookup(dev: Device, args) -> dict:
    import one_embedding as oe
    from one_embedding.kernels import device_ops, device_unique

    xp, e = dev.xp, args.lookup_dim
    rng = np.random.default_rng(0)
    n = args.batch_size * 26
    batches = [zipf_ids(rng, 1.05, args.lookup_keys, (args.batch_size, 26)) for _ in range(3)]
    store = oe.make_device_mem_store_options(None, capacity=args.lookup_keys)
    emb = oe.MultiTableEmbedding("lookup", e, np.float32, np.int64, None, store,
                                 device="cpu" if dev.dry_run else "cuda")
    opt = oe.Optimizer(oe.optim.SGD(lr=0.0), embeddings=[emb])
    for ids in batches:                      # store every key of the timed batches first
        out = emb(ids)
        emb.backward(xp.zeros(out.shape, dtype=xp.float32))
        opt.step()
    ids = xp.asarray(batches[0])
    out_bytes = n * e * 4
    t_lookup = dev.seconds(lambda: emb(ids), args.repeats)
    src = xp.ones((n, e), dtype=xp.float32)
    dst = xp.empty_like(src)
    t_copy = dev.seconds(lambda: xp.copyto(dst, src), args.repeats)
    copy_bw = 2 * out_bytes / t_copy
    lookup_bw = (8 + 8 * e) * n / t_lookup
    rows = [{"what": "device copy (baseline), read + write", "ms": 1e3 * t_copy,
             "GB/s": copy_bw / 1e9, "x copy": 1.0},
            {"what": "lookup emb(ids): unique + find + gather", "ms": 1e3 * t_lookup,
             "GB/s": lookup_bw / 1e9, "x copy": lookup_bw / copy_bw}]
    parts = {}
    if not dev.dry_run:                      # the parts, on the device path's own ops
        launch = emb.launch
        keys = ids.reshape(-1).view(xp.uint64)
        uniq, inverse = device_unique.unique_ids(keys, launch)
        # the hash-table dedup against the sort-based one it replaced: same results, timed apart
        by_sorting = device_unique.unique_ids_by_sorting(keys, launch)
        unique_same = bool((uniq.shape == by_sorting[0].shape) and (uniq == by_sorting[0]).all()
                           and (inverse == by_sorting[1]).all())
        chain = emb._owner()._chain
        lines, _ = chain.lookup(uniq)
        parts = {"unique (hash table: unique_ids)":
                     dev.seconds(lambda: device_unique.unique_ids(keys, launch), args.repeats),
                 "unique (sort, the replaced baseline: unique_ids_by_sorting)":
                     dev.seconds(lambda: device_unique.unique_ids_by_sorting(keys, launch), args.repeats),
                 FIND_PART: dev.seconds(lambda: chain.lookup(uniq), args.repeats),
                 FIND_SCALAR_PART: _switched_off(
                     "VECTOR_LINE_COPIES",
                     lambda: dev.seconds(lambda: chain.lookup(uniq), args.repeats)),
                 # the step's gather (embedding._embed_on_device, one rank, fp32): the first E
                 # columns of the found lines read in place, at 16 bytes per thread where the
                 # layout allows it; the scalar kernel (4 bytes per thread) as its baseline
                 GATHER_PART:
                     dev.seconds(lambda: device_ops.gather_rows(lines, inverse, launch, check_index=False,
                                                                columns=e), args.repeats),
                 GATHER_SCALAR_PART:
                     dev.seconds(lambda: device_ops.gather_rows(lines, inverse, launch, check_index=False,
                                                                columns=e, vector=False), args.repeats)}
        for name, t in parts.items():
            rows.append({"what": f"  part: {name}", "ms": 1e3 * t})
            if name in (GATHER_PART, GATHER_SCALAR_PART):
                rows[-1].update({"GB/s": (8 + 8 * e) * n / t / 1e9,
                                 "x copy": (8 + 8 * e) * n / t / copy_bw})
        # CuPy's pool hands out 256-byte aligned outputs: the lines decide
        gather_vectorised = bool(device_ops.vector_lanes(np.float32, (e, lines.shape[1]), (lines,)))
        find_vectorised = bool(device_ops.line_vector(np.float32, lines.shape[1], (lines,)))
        dedup_find = bench_dedup_find(dev, args, emb, ids)
        rows += dedup_find.pop("rows")
        update = bench_grad_update(dev, args, launch, inverse, int(uniq.shape[0]), copy_bw)
        rows += update.pop("rows")
        patch = bench_refresh_patch(dev, args, launch, keys, batches[1])
        rows += patch.pop("rows")
        unique_count = int(uniq.shape[0])
        unique_vs_sort = {"speedup": parts["unique (sort, the replaced baseline: unique_ids_by_sorting)"]
                          / parts["unique (hash table: unique_ids)"], "same_results": unique_same}
    else:
        unique_count = int(np.unique(batches[0]).size)
        unique_vs_sort, update, dedup_find, gather_vectorised, patch = {}, {}, {}, None, {}
        find_vectorised = None
    emb.close()
    return {"ids": n, "unique": unique_count, "dim": e, "copy_GBps": copy_bw / 1e9,
            "lookup_GBps": lookup_bw / 1e9, "ratio": lookup_bw / copy_bw, "rows": rows,
            "parts_s": parts, "gather_vectorised": gather_vectorised,
            "find_vectorised": find_vectorised,
            "unique_hash_vs_sort": unique_vs_sort, "grad_update": update,
            "dedup_find": dedup_find, "refresh_patch": patch}


def print_lookup(lookup: dict, summary: list) -> None:
    """Prints ``bench_lookup``'s table and each comparison of a part with its baseline, and
    appends their short forms to ``summary`` (bench_gpu's last line)."""

    def report(line: str, short: str) -> None:
        print(line)
        summary.append(short)

    print(f"\n## lookup: {lookup['ids']:,} ids ({lookup['unique']:,} unique), dim {lookup['dim']}")
    print(markdown_table(lookup["rows"], ["what", "ms", "GB/s", "x copy"]))
    versus = lookup["unique_hash_vs_sort"]
    if versus:
        print(f"unique: the hash table is {versus['speedup']:.2f}x the sort's speed "
              f"(same results: {versus['same_results']})")
    verdict = "met" if lookup["ratio"] >= LOOKUP_GOAL else "not met"
    summary.append(f"lookup {lookup['lookup_GBps']:.0f} GB/s = {lookup['ratio']:.2f}x copy "
                   f"{lookup['copy_GBps']:.0f} GB/s (FBGEMM {FBGEMM_HBM_SHARE[0]:.2f}-"
                   f"{FBGEMM_HBM_SHARE[1]:.2f}x; goal {LOOKUP_GOAL}x: {verdict})")
    if versus:
        summary.append(f"unique: hash {versus['speedup']:.2f}x sort")
    parts = lookup["parts_s"]
    if GATHER_PART in parts:
        speedup = parts[GATHER_SCALAR_PART] / parts[GATHER_PART]
        report(f"gather: the step's kernel is {speedup:.2f}x the scalar one's speed (16 bytes "
               f"per thread: {lookup['gather_vectorised']})",
               f"gather: {speedup:.2f}x scalar (vectorised: {lookup['gather_vectorised']})")
    if FIND_PART in parts:
        speedup = parts[FIND_SCALAR_PART] / parts[FIND_PART]
        report(f"find: the step's line copies are {speedup:.2f}x the one-element copies' "
               f"speed (16 bytes per lane: {lookup['find_vectorised']})",
               f"find: {speedup:.2f}x one-element copies (vectorised: "
               f"{lookup['find_vectorised']})")
    if lookup["dedup_find"]:
        fusion = lookup["dedup_find"]
        line = (f"dedup + find: fused {fusion['speedup']:.2f}x two kernels (same results: "
                f"{fusion['same_results']})")
        report(line, line)
    if lookup["grad_update"]:
        update = lookup["grad_update"]
        summary.append(f"grad sum + update: fused {update['speedup']:.2f}x two kernels "
                       f"(same bits: {update['same_results']})")
        report(f"grad sum + update: the fused kernel's 16-byte row accesses are "
               f"{update['vector_speedup']:.2f}x the one-element ones' speed (vectorised: "
               f"{update['vectorised']}; same bits: {update['vector_same_results']})",
               f"row update: {update['vector_speedup']:.2f}x one-element accesses "
               f"(vectorised: {update['vectorised']})")
    if lookup["refresh_patch"]:
        patch = lookup["refresh_patch"]
        report(f"refresh patch: the hash index is {patch['speedup']:.2f}x the sort's speed "
               f"(same bits: {patch['same_results']})",
               f"refresh patch: hash {patch['speedup']:.2f}x sort (same bits: "
               f"{patch['same_results']})")


def _switched_off(switch: str, timed):
    """``timed()`` with ``device_ops.<switch>`` False, restored after: ``VECTOR_LINE_COPIES``
    (the line-copying kernels at one element per lane) or ``VECTOR_ROW_UPDATES`` (the row
    optimizer kernels at one element per thread)."""
    from one_embedding.kernels import device_ops

    before = getattr(device_ops, switch)
    setattr(device_ops, switch, False)
    try:
        return timed()
    finally:
        setattr(device_ops, switch, before)


def bench_dedup_find(dev: Device, args, emb, ids) -> dict:
    """The dedup and the store's find of one batch on the one-rank device_mem path, two ways in
    the same run: the dedup's own output pass then the find (``unique_ids_fixed``, then
    ``chain.lookup(live=count)``: two kernels, the unique keys written then read back) and the
    find fused into the output pass (``dedup_passes_fixed`` + ``chain.lookup_deduped``: one
    kernel); results compared bit for bit (unique keys, inverse, first positions, count, found,
    the lines of the keys found). Then the whole ``emb(ids)`` with the fusion switched the
    other way (``device_unique.FIND_IN_DEDUP``, off by default) beside the lookup row above."""
    from one_embedding.kernels import device_unique

    launch, chain, xp = emb.launch, emb._owner()._chain, dev.xp
    keys = ids.reshape(-1).view(xp.uint64)

    def unfused():
        fixed = device_unique.unique_ids_fixed(keys, launch)
        return (fixed, *chain.lookup(fixed.keys, live=fixed.count))

    def fused():
        return chain.lookup_deduped(device_unique.dedup_passes_fixed(keys, launch))

    (want, want_lines, want_found), (got, got_lines, got_found) = unfused(), fused()
    count = int(launch.to_host(want.count, reason="bench: unique count")[0])
    held = want_found[:count]          # the lines of missing keys are left as they were
    same = all(bool((a == b).all()) for a, b in zip(got, want, strict=True)) and \
        bool((got_found == want_found).all()) and \
        bool((got_lines[:count][held].view(xp.uint32) ==
              want_lines[:count][held].view(xp.uint32)).all())
    t_unfused = dev.seconds(unfused, args.repeats)
    t_fused = dev.seconds(fused, args.repeats)
    before = device_unique.FIND_IN_DEDUP
    device_unique.FIND_IN_DEDUP = not before
    try:
        t_lookup_other = dev.seconds(lambda: emb(ids), args.repeats)
    finally:
        device_unique.FIND_IN_DEDUP = before
    rows = [{"what": "  part: dedup + find, two kernels (unique_ids_fixed, chain.lookup(live))",
             "ms": 1e3 * t_unfused},
            {"what": "  part: dedup + find fused (dedup_passes_fixed, chain.lookup_deduped)",
             "ms": 1e3 * t_fused},
            {"what": "lookup emb(ids) with the dedup and find "
                     f"{'unfused (FIND_IN_DEDUP off)' if before else 'fused (FIND_IN_DEDUP on)'}",
             "ms": 1e3 * t_lookup_other}]
    return {"rows": rows, "unfused_s": t_unfused, "fused_s": t_fused,
            "lookup_other_fusion_s": t_lookup_other, "find_in_dedup": before,
            "speedup": t_unfused / t_fused,
            "same_results": same}


def bench_grad_update(dev: Device, args, launch, inverse, n_unique: int, copy_bw: float) -> dict:
    """The gradient sum + Adam row update of the lookup's ids: two kernels against the fused
    one, on the same gradient rows (n, E) and lines (u, 3E) -> {"rows": table rows, "two_s",
    "fused_s", "speedup", "same_results"}."""
    import one_embedding as oe
    from one_embedding.kernels import device_ops, device_unique, fused_update

    xp, e = dev.xp, args.lookup_dim
    n = inverse.shape[0]
    rng = np.random.default_rng(1)
    grads = xp.asarray((rng.standard_normal((n, e)) * 1e-3).astype(np.float32))
    start = xp.asarray(rng.uniform(-0.05, 0.05, (n_unique, 3 * e)).astype(np.float32))
    start[:, e:] = 0.0
    opt = oe.optim.Adam(lr=1e-3)
    two_lines, fused_lines = start.copy(), start.copy()

    def two_kernels(lines=two_lines):
        sums = device_unique.segment_sum(grads, inverse, n_unique, launch, check_inverse=False)
        device_ops.update_lines(opt, lines, sums, 1, launch)

    def fused(lines=fused_lines):
        summed = fused_update.SummedGradients(grads, inverse, n_unique, launch)
        fused_update.update_lines_summed(opt, lines, summed, 1)

    two_kernels()
    fused()
    scalar_lines = start.copy()
    _switched_off("VECTOR_ROW_UPDATES", lambda: fused(scalar_lines))
    same = bool((two_lines.view(xp.int32) == fused_lines.view(xp.int32)).all())
    scalar_same = bool((scalar_lines.view(xp.int32) == fused_lines.view(xp.int32)).all())
    t_two = dev.seconds(two_kernels, args.repeats)
    t_fused = dev.seconds(fused, args.repeats)
    t_scalar = _switched_off("VECTOR_ROW_UPDATES", lambda: dev.seconds(fused, args.repeats))
    vectorised = bool(device_ops.row_update_vector(e, fused_lines.shape[1], (fused_lines,)))
    moved = 4 * e * n + 2 * 12 * e * n_unique
    rows = [{"what": "  part: grad sum + Adam update, two kernels (segment_sum, update_lines)",
             "ms": 1e3 * t_two, "GB/s": moved / t_two / 1e9, "x copy": moved / t_two / copy_bw},
            {"what": f"  part: grad sum + Adam update, fused (optim_summed_adam; same bits: {same})",
             "ms": 1e3 * t_fused, "GB/s": moved / t_fused / 1e9,
             "x copy": moved / t_fused / copy_bw},
            {"what": f"  part: {UPDATE_SCALAR_PART} (same bits: {scalar_same})",
             "ms": 1e3 * t_scalar, "GB/s": moved / t_scalar / 1e9,
             "x copy": moved / t_scalar / copy_bw}]
    return {"rows": rows, "two_s": t_two, "fused_s": t_fused, "speedup": t_two / t_fused,
            "same_results": same, "fused_scalar_s": t_scalar, "vectorised": vectorised,
            "vector_speedup": t_scalar / t_fused, "vector_same_results": scalar_same}


def bench_refresh_patch(dev: Device, args, launch, keys, next_ids) -> dict:
    """The write log's patch of a prefetched lookup (``write_log.patch_rows_on_device``), as a
    prefetch depth of 1 runs it every step: the rows of the next batch's fixed-capacity lookup
    (``next_ids``) take the lines of this batch's put (``keys``' unique keys, the same
    capacity; Adagrad's lines of 2E floats), by the hash index (the default) and by the sort it
    replaced (``HASHED_PATCH`` off), lines and flags compared bit for bit -> {"rows",
    "hashed_s", "sorted_s", "speedup", "same_results"}."""
    from one_embedding import write_log
    from one_embedding.kernels import device_unique
    from one_embedding.step import OwnerRows

    xp, e = dev.xp, args.lookup_dim
    put = device_unique.unique_ids_fixed(keys, launch)
    mine = device_unique.unique_ids_fixed(xp.asarray(next_ids).reshape(-1).view(xp.uint64),
                                          launch)
    n = put.keys.shape[0]
    rng = np.random.default_rng(2)
    put_lines = xp.asarray(rng.standard_normal((n, 2 * e)).astype(np.float32))
    start = xp.asarray(rng.standard_normal((mine.keys.shape[0], 2 * e)).astype(np.float32))
    results = {}

    def patch(hashed: bool, rows):
        saved = write_log.HASHED_PATCH
        write_log.HASHED_PATCH = hashed
        try:
            write_log.patch_rows_on_device(xp, rows, [(put.keys, put_lines, put.count)], launch)
        finally:
            write_log.HASHED_PATCH = saved

    for hashed in (True, False):
        rows = OwnerRows(mine.keys, None, start.copy(), xp.zeros(n, dtype=xp.bool_), 0, 0,
                         live=mine.count)
        patch(hashed, rows)
        results[hashed] = rows
        results[hashed, "s"] = dev.seconds(lambda rows=rows, hashed=hashed: patch(hashed, rows),
                                           args.repeats)
    same = bool((results[True].lines.view(xp.int32) == results[False].lines.view(xp.int32)).all()
                and (results[True].found == results[False].found).all())
    hit = int(results[True].found.sum())
    rows = [{"what": f"  part: refresh patch, hash index ({hit:,} of the next batch's rows put; "
                     f"same bits: {same})", "ms": 1e3 * results[True, "s"]},
            {"what": "  part: refresh patch, sort + binary search (baseline: HASHED_PATCH off)",
             "ms": 1e3 * results[False, "s"]}]
    return {"rows": rows, "hashed_s": results[True, "s"], "sorted_s": results[False, "s"],
            "speedup": results[False, "s"] / results[True, "s"], "same_results": same,
            "rows_put": hit}


def bench_interaction_input(dev: Device, args) -> dict:
    """The rows of a DLRM batch into the dot interaction's input, the path before and the fused
    gather (issue 32 item 3), on random rows: (B * 26) rows of ``--lookup-dim`` from a table of
    B * 6 unique rows (Criteo's share of unique ids), z (B, E) beside them.

    Before: fp32 (amp off) gathers (B, 26, E) float32 and concatenates [z, rows] (B, 27, E);
    under AMP it gathers float32 and the interaction reads them in place. Fused: one gather
    into the (B, 27, E) buffer at slots 1.. (float32, or bf16 patterns: half the bytes written
    and read by the interaction twice) plus z into slot 0. The dry run times the numpy twins."""
    from one_embedding.kernels import device_ops, layout_ops

    xp, e, batch = dev.xp, args.lookup_dim, args.batch_size
    rng = np.random.default_rng(2)
    table = xp.asarray(rng.standard_normal((batch * 6, e)).astype(np.float32))
    inverse = xp.asarray(rng.integers(0, batch * 6, (batch, 26)).astype(np.int64))
    z = xp.asarray(rng.standard_normal((batch, e)).astype(np.float32))
    launch = None if dev.dry_run else device_ops.cupy_launcher()

    def before():
        rows = table[inverse] if dev.dry_run else device_ops.gather_rows(table, inverse, launch,
                                                                          check_index=False)
        return rows, xp.concatenate([z[:, None], rows], axis=1)

    def fused(precision):
        target = layout_ops.empty_input(xp, batch, 27, e, precision, 1, launch)
        layout_ops.gather_into(table, inverse, target, 1, launch)
        layout_ops.write_slot(z, target, 0, launch)
        return target

    t_concat = dev.seconds(before, args.repeats)
    t_gather = dev.seconds(lambda: before()[0] if dev.dry_run else
                           device_ops.gather_rows(table, inverse, launch, check_index=False),
                           args.repeats)
    t_fp32 = dev.seconds(lambda: fused("off"), args.repeats)
    t_bf16 = dev.seconds(lambda: fused("bf16"), args.repeats)
    n = batch * 26
    rows = [{"what": "before, amp off: gather (B, 26, E) fp32 + concat [z, rows]",
             "ms": 1e3 * t_concat, "MB written": (4 * n * e + 4 * (n + batch) * e) / 1e6,
             "x before": 1.0},
            {"what": "fused, amp off: gather into (B, 27, E) fp32 + z", "ms": 1e3 * t_fp32,
             "MB written": 4 * (n + batch) * e / 1e6, "x before": t_concat / t_fp32},
            {"what": "before, AMP: gather (B, 26, E) fp32 (read in place, rounded in registers)",
             "ms": 1e3 * t_gather, "MB written": 4 * n * e / 1e6, "x before": 1.0},
            {"what": "fused, bf16: gather into (B, 27, E) bf16 patterns + z", "ms": 1e3 * t_bf16,
             "MB written": 2 * (n + batch) * e / 1e6, "x before": t_gather / t_bf16}]
    return {"rows": rows, "speedup_fp32": t_concat / t_fp32, "speedup_bf16": t_gather / t_bf16}
