"""The README's Python example runs as written (with its path moved into a temp folder)."""
import json
import re

import pytest

import helpers

README = helpers.ROOT / "README.md"


def test_readme_python_example_runs(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "the README lost its Python example"
    code = blocks[0].replace("/tmp/my_table", str(tmp_path / "table"))
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert scope["out"].shape == (4096, 26, 64)
    assert (tmp_path / "table" / "0-1" / "snapshots" / "step1" / "manifest.json").is_file()


def test_readme_shows_exactly_two_setup_commands_at_the_top():
    first = re.search(r"```bash\n(.*?)```", README.read_text(), re.S).group(1)
    commands = [line for line in first.splitlines() if line and not line.startswith("#")]
    assert len(commands) == 2
    assert "one-embedding train --model dlrm --data synthetic" in commands[0]
    assert "pytest" in commands[1]
    ci = (README.parent / ".ci" / "run").read_text()
    assert commands[1].replace("python -m pip install", "python -m pip install -q") in ci


def section_example(heading: str) -> str:
    """The first Python block under the README's ``## heading``."""
    text = README.read_text()
    start = text.index(f"## {heading}\n")
    end = text.find("\n## ", start + 1)
    blocks = re.findall(r"```python\n(.*?)```", text[start:end if end > 0 else None], re.S)
    assert blocks, f"the README's '{heading}' section lost its example"
    return blocks[0]


def test_readme_pytorch_example_trains_and_saves(tmp_path):
    pytest.importorskip("torch")
    code = section_example("Using it from PyTorch").replace("/tmp/torch_table", str(tmp_path / "t"))
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert scope["step"] == 9 and 0.0 < scope["loss"].item() < 1.0
    assert (tmp_path / "t" / "0-1" / "snapshots" / "final" / "manifest.json").is_file()


def test_readme_oneflow_example_trains_and_saves(tmp_path):
    code = section_example("Coming from OneFlow").replace("/tmp/of_table", str(tmp_path / "t"))
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert 0.0 < float(scope["loss"]) < 0.69  # it learned: below the loss of a constant 0.5
    manifest = json.loads((tmp_path / "t" / "0-1" / "snapshots" / "final" / "manifest.json")
                          .read_text())
    assert manifest["row_count"] > 1000 and manifest["embedding_name"] == "sparse_embedding"


def test_readme_lifecycle_example_builds_its_rules():
    code = "import one_embedding as oe\n" + section_example("Feature lifecycle: admission and eviction")
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    rules = scope["store"].lifecycle
    assert (rules.admit_min_count, rules.steps_to_live, rules.max_rows) == (4, 2000, 500_000_000)
    assert rules.sweep_interval == 500  # "default T/4", as the section says


def test_every_file_the_readme_links_exists():
    """Relative links and the paths it names as files (`docs/...`, `benchmarks/...`) resolve
    in the repository: nothing points outside it."""
    text = README.read_text()
    links = re.findall(r"\]\(([^)#\s]+)\)", text)
    named = re.findall(r"`((?:docs|benchmarks|examples|scripts|tests)/[^`\s]*\.[a-z]+)`", text)
    assert links or named
    missing = [p for p in links + named if "://" not in p
               and not (helpers.ROOT / p.split("::")[0]).exists()]
    assert not missing, missing
    assert "../shared" not in text and "REFERENCE.md" not in text and "DESIGN.md" not in text
