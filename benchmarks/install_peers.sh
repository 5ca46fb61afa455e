#!/usr/bin/env bash
# Install the peer libraries of the DLRM throughput benchmark (TorchRec + FBGEMM, CPU build) on top
# of an already-installed CPU torch, without ever letting pip replace that torch.
#
# Every package goes in with --no-deps: torchrec's metadata asks for "fbgemm-gpu" (the CUDA build)
# and tensordict/torchmetrics ask for "torch", so a resolving install could pull a second torch or
# a CUDA fbgemm. The list below is the closure that `import torchrec, fbgemm_gpu` actually needs,
# read from the wheels' METADATA (Requires-Dist) and checked by importing.
#
# Usage: bash benchmarks/install_peers.sh        (PYTHON=/path/to/python to pick an interpreter)
set -euo pipefail

PY="${PYTHON:-python}"

torch_before="$("$PY" -c 'import torch; print(torch.__version__)')" || {
    echo "install_peers.sh: torch is not importable with $PY; install the CPU torch first" >&2
    exit 1
}
echo "torch before: $torch_before"

# torchrec 1.8 pairs with fbgemm-gpu 1.8, both built against torch 2.13 (checked by import below).
# tensordict: imported by torchrec.distributed (pulled in by torchrec/__init__).
# pyvers, cloudpickle: tensordict's requirements.  pyre-extensions -> typing-inspect ->
# mypy-extensions: torchrec's typing helpers.  torchmetrics 1.0.3 (exact pin in torchrec's
# metadata) -> lightning-utilities: torchrec.metrics.
"$PY" -m pip install --no-deps \
    "torchrec==1.8.*" \
    "fbgemm-gpu-cpu==1.8.*" \
    "tensordict==0.15.*" \
    "pyvers>=0.2,<0.3" \
    "cloudpickle" \
    "pyre-extensions" \
    "typing-inspect" \
    "mypy-extensions" \
    "torchmetrics==1.0.3" \
    "lightning-utilities"

torch_after="$("$PY" -c 'import torch; print(torch.__version__)')"
if [[ "$torch_after" != "$torch_before" ]]; then
    echo "install_peers.sh: torch changed from $torch_before to $torch_after;" \
        "reinstall $torch_before" >&2
    exit 1
fi

# Importing from a neutral directory so a local folder named like a package cannot shadow it.
(cd / && "$PY" - <<'EOF'
import torch, fbgemm_gpu, torchrec
from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection  # noqa: F401
offsets = torch.tensor([0, 1, 3], dtype=torch.int64)
# One fbgemm CPU operator call proves the C++ extension loaded against this torch.
torch.ops.fbgemm.asynchronous_complete_cumsum(offsets)
print(f"ok: torch {torch.__version__}, fbgemm_gpu {fbgemm_gpu.__version__}, "
      f"torchrec {torchrec.__version__}, cuda available: {torch.cuda.is_available()}")
EOF
)
