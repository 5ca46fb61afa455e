"""The example scripts run end to end as a user would run them: a few steps, then AUC, samples/s
and a snapshot on disk."""
import os
import re
import subprocess
import sys

import pytest

import helpers

ROOT = helpers.ROOT
EXAMPLES = ROOT / "examples"


def run_example(script, tmp_path, *args):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--persistent-path", str(tmp_path / "store"),
         "--steps", "30", "--eval-every", "15", *args],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def check_report(out, tmp_path, steps=30):
    evals = re.findall(r"step\s+(\d+).*eval AUC (\S+)\s+logloss (\S+)\s+([\d,]+) samples/s", out)
    assert [int(s) for s, *_ in evals] == [15, steps], out
    for _, auc, logloss, rate in evals:
        assert 0.0 <= float(auc) <= 1.0 and float(logloss) > 0 and int(rate.replace(",", "")) > 0
    assert re.search(rf"trained {steps} steps, [\d,]+ samples: [\d,]+ samples/s", out), out
    manifests = list((tmp_path / "store").glob("*/snapshots/final/*"))
    assert manifests, f"no snapshot 'final' under {tmp_path / 'store'}"


@pytest.mark.parametrize("script, store", [
    ("train_dlrm.py", "device_mem"),
    ("train_dcn.py", "cached_host_mem"),
    ("train_deepfm.py", "cached_ssd"),
])
def test_example_trains_on_synthetic_data(script, store, tmp_path):
    out = run_example(script, tmp_path, "--store", store, "--batch-size", "256")
    check_report(out, tmp_path)


def test_example_trains_on_tsv_files(tmp_path):
    data = tmp_path / "day_0.tsv"
    helpers.write_criteo_tsv(data, 4000)
    out = run_example("train_deepfm.py", tmp_path, "--data", str(data), "--batch-size", "128")
    check_report(out, tmp_path)


def test_example_help_names_reference_sizes():
    proc = subprocess.run([sys.executable, str(EXAMPLES / "train_dlrm.py"), "--help"],
                          capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=60)
    assert proc.returncode == 0 and "--reference-sizes" in proc.stdout, proc.stderr


@pytest.mark.parametrize("script", ["train_dlrm.py", "train_dcn.py", "train_deepfm.py",
                                    "train_dlrm_torch.py"])
def test_example_without_a_path_leaves_no_temporary_folder(script, tmp_path):
    """Without --persistent-path the store lives in a temporary folder that the script removes
    at the end (the system's temporary folder is pointed at tmp_path/tmp to look)."""
    if script == "train_dlrm_torch.py":
        pytest.importorskip("torch")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(tmp),
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    store = [] if script == "train_dlrm_torch.py" else ["--store", "cached_ssd"]
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--steps", "2", "--eval-every", "2",
         "--batch-size", "64", *store], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "was a temporary folder and is removed" in proc.stdout, proc.stdout
    # torch keeps a cache of its own there (torchinductor_<user>), shared by every torch program
    left = [p.name for p in tmp.iterdir() if not p.name.startswith("torchinductor_")]
    assert left == []


def test_torch_example_without_torch_names_the_extra():
    """Where torch is not installed, the PyTorch example says which extra to install in one
    line (no traceback), as `one-embedding serve` does for its extra."""
    code = ("import runpy, sys\n"
            "sys.modules['torch'] = None  # as if torch were not installed\n"
            f"sys.argv = [{str(EXAMPLES / 'train_dlrm_torch.py')!r}]\n"
            f"runpy.run_path(sys.argv[0], run_name='__main__')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "pip install 'one_embedding[torch]'" in proc.stderr and "Traceback" not in proc.stderr, \
        proc.stderr


def test_readme_sample_output_has_the_scripts_format():
    """examples/README.md's sample output is what train_dlrm.py prints with its defaults: an
    evaluation line every 50 of 200 steps (check_report's format), then the final summary."""
    text = (EXAMPLES / "README.md").read_text()
    sample = re.search(r"`python examples/train_dlrm.py`\nwith the defaults printed.*?```\n(.*?)```",
                       text, re.S).group(1)
    evals = re.findall(r"step\s+(\d+).*eval AUC (\S+)\s+logloss (\S+)\s+([\d,]+) samples/s", sample)
    assert [int(s) for s, *_ in evals] == [50, 100, 150, 200], sample
    assert re.search(r"trained 200 steps, 102,400 samples: [\d,]+ samples/s; [\d,]+ rows stored; "
                     r"snapshot 'final' in \S+\n\S+ was a temporary folder and is removed", sample)
