"""Global-memory loads in nvcc's PTX of the step's kernels, this tree's against a git revision's:
how many ``ld.global`` instructions (16-byte ``.v4`` ones in brackets) each kernel's float
instantiation holds. A loop body with one load whose store may alias it keeps one load in flight
per thread; loads issued ahead of the stores show here as more of them. No GPU needed (nvcc only).

    python scripts/ptx_loads.py [REV] [--arch sm_90]

REV (default HEAD) is compiled from ``git archive``; prints a markdown table.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CUDA = Path("src/one_embedding/kernels/cuda")
#: source -> the kernels whose loads are counted (the step's elementwise, gather and update ones)
KERNELS = {
    "mlp": ["mlp_bias_act_forward", "mlp_bias_act_backward"],
    "dense": ["dense_bias_act_cast", "dense_bias_act_backward_cast",
              "dense_interaction_forward_tile", "dense_interaction_forward_vector",
              "dense_interaction_backward_tile", "dense_interaction_backward_blocked"],
    "embedding": ["embedding_gather_vector", "embedding_gather_into_vector",
                  "embedding_patch_rows"],
    "optim": ["optim_summed_adagrad", "optim_summed_adam"],
}


def load_counts(cuda_dir: Path, arch: str) -> dict[str, tuple[int, int]]:
    """kernel -> (ld.global instructions, of which 16-byte) in its float instantiation."""
    counts = {}
    with tempfile.TemporaryDirectory() as work:
        for source, names in KERNELS.items():
            ptx = Path(work) / f"{source}.ptx"
            subprocess.run(["nvcc", "-std=c++17", "--fmad=false", "-ftz=true",
                            "-DONE_EMBEDDING_INSTANTIATE", "-I", str(cuda_dir), f"-arch={arch}",
                            "--ptx", "-o", str(ptx), str(cuda_dir / f"{source}.cu")], check=True)
            text = ptx.read_text()
            starts = [m.start() for m in re.finditer(r"\.visible \.entry", text)] + [len(text)]
            for begin, end in zip(starts, starts[1:]):
                entry = text[begin:begin + 200].split()[2]
                for name in names:
                    if f"{len(name)}{name}IfE" in entry:      # the mangled float instantiation
                        body = text[begin:end]
                        counts[name] = (body.count("ld.global"), len(re.findall(
                            r"ld\.global(?:\.nc)?\.v4", body)))
    return counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rev", nargs="?", default="HEAD", help="the revision to compare against")
    ap.add_argument("--arch", default="sm_90")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as old:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.rev, str(CUDA)],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", old], input=archive, check=True)
        before = load_counts(Path(old) / CUDA, args.arch)
    after = load_counts(ROOT / CUDA, args.arch)
    print(f"| kernel (float, {args.arch}) | ld.global in {args.rev} (16-byte) | in this tree |")
    print("|---|---|---|")
    for names in KERNELS.values():
        for name in names:
            print(f"| {name} | {_cell(before.get(name))} | {_cell(after.get(name))} |")
    return 0


def _cell(count) -> str:
    return "-" if count is None else f"{count[0]} ({count[1]})"


if __name__ == "__main__":
    sys.exit(main())
