"""The README's and the docs pages' Python examples run as written (with their paths moved into a
temp folder), and every file they name exists."""
import json
import re

import pytest

import helpers

README = helpers.ROOT / "README.md"
DOCS = helpers.ROOT / "docs"


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


def page_example(page: str) -> str:
    """The first Python block of a docs page (``docs/<page>``)."""
    blocks = re.findall(r"```python\n(.*?)```", (DOCS / page).read_text(), re.S)
    assert blocks, f"docs/{page} lost its example"
    return blocks[0]


def test_docs_pytorch_example_trains_and_saves(tmp_path):
    pytest.importorskip("torch")
    code = page_example("pytorch.md").replace("/tmp/torch_table", str(tmp_path / "t"))
    scope: dict = {}
    exec(compile(code, "docs/pytorch.md", "exec"), scope)
    assert scope["step"] == 9 and 0.0 < scope["loss"].item() < 1.0
    assert (tmp_path / "t" / "0-1" / "snapshots" / "final" / "manifest.json").is_file()


def test_docs_oneflow_example_trains_and_saves(tmp_path):
    code = page_example("oneflow.md").replace("/tmp/of_table", str(tmp_path / "t"))
    scope: dict = {}
    exec(compile(code, "docs/oneflow.md", "exec"), scope)
    assert 0.0 < float(scope["loss"]) < 0.69  # it learned: below the loss of a constant 0.5
    manifest = json.loads((tmp_path / "t" / "0-1" / "snapshots" / "final" / "manifest.json")
                          .read_text())
    assert manifest["row_count"] > 1000 and manifest["embedding_name"] == "sparse_embedding"


def test_docs_lifecycle_example_builds_its_rules():
    code = "import one_embedding as oe\n" + page_example("lifecycle.md")
    scope: dict = {}
    exec(compile(code, "docs/lifecycle.md", "exec"), scope)
    rules = scope["store"].lifecycle
    assert (rules.admit_min_count, rules.steps_to_live, rules.max_rows) == (4, 2000, 500_000_000)
    assert rules.sweep_interval == 500  # "default T/4", as the page says


def test_readme_is_what_a_newcomer_needs():
    """The README keeps the two commands, the API example, the store presets and the serving
    quick start, and links every guide page in docs/; the rest lives in those pages."""
    text = README.read_text()
    headings = re.findall(r"^## (.+)$", text, re.M)
    for needed in ("Python API", "Store presets", "Serving: `one-embedding serve`", "Documentation"):
        assert needed in headings, headings
    for page in sorted(DOCS.glob("*.md")):
        if page.name != "index.md":
            assert f"](docs/{page.name})" in text, f"the README does not link docs/{page.name}"
    assert len(text.splitlines()) < 300


def named_files(text: str, base) -> list[str]:
    """Relative links (from ``base``) and the paths a page names as files in backticks (from the
    repository root) that do not exist."""
    links = re.findall(r"\]\(([^)#\s]+)\)", text)
    named = re.findall(r"`((?:docs|benchmarks|examples|scripts|tests)/[^`\s]*\.[a-z]+)`", text)
    missing = [p for p in links if "://" not in p and not (base / p).exists()]
    missing += [p for p in named if not (helpers.ROOT / p.split("::")[0]).exists()]
    return missing


def test_every_file_the_readme_links_exists():
    """Relative links and the paths it names as files (`docs/...`, `benchmarks/...`) resolve
    in the repository: nothing points outside it."""
    text = README.read_text()
    assert re.findall(r"\]\(([^)#\s]+)\)", text)
    assert not named_files(text, helpers.ROOT)
    assert "../shared" not in text and "REFERENCE.md" not in text and "DESIGN.md" not in text


@pytest.mark.parametrize("page", sorted(p.name for p in DOCS.glob("*.md")))
def test_every_file_a_docs_page_names_exists(page):
    text = (DOCS / page).read_text()
    assert not named_files(text, DOCS), page
    assert "../shared" not in text and "REFERENCE.md" not in text


@pytest.mark.parametrize("name", ["CONTRIBUTING.md", "CHANGELOG.md"])
def test_every_file_the_guides_name_exists(name):
    assert not named_files((helpers.ROOT / name).read_text(), helpers.ROOT)
