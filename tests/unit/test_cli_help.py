"""``one-embedding --help`` and every subcommand's: each option explained, only files that exist
cited, defaults shown once, every subcommand named (issue 31)."""
import argparse
import re
import subprocess
import sys

import pytest

import helpers
import one_embedding as oe
from one_embedding import cli
from one_embedding.config import OPTIMIZERS

#: what a help text may cite as a file to read: documentation and source (not data or output
#: names such as train.txt or curves.png)
CITED_FILE = re.compile(r"[\w./-]+\.(?:md|rst|py|toml|cfg|ini|html|ipynb)\b")


def parsers():
    """[(name, parser)]: the top level and each subcommand."""
    top = cli.build_parser()
    (sub,) = [a for a in top._actions if isinstance(a, argparse._SubParsersAction)]
    return [("one-embedding", top)] + [(f"one-embedding {name}", p)
                                       for name, p in sub.choices.items()]


def test_every_subcommand_is_listed():
    names = [name for name, _ in parsers()[1:]]
    assert {"train", "bench", "convert", "inspect", "plan", "serve", "plot"} <= \
        {n.split()[1] for n in names}
    description = cli.build_parser().description
    for name in names:
        assert name.split()[1] in description, name


@pytest.mark.parametrize("name, parser", parsers(), ids=[n for n, _ in parsers()])
def test_every_option_has_a_help_text(name, parser):
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        text = action.help or ""
        what = f"{name} {'/'.join(action.option_strings) or action.dest}"
        assert text and not text.startswith("default:"), f"{what} has no help text: {text!r}"
        # one default each: a text that says its default is not given argparse's as well
        assert len(re.findall(r"\(default", text)) <= 1, f"{what}: {text!r}"


@pytest.mark.parametrize("name, parser", parsers(), ids=[n for n, _ in parsers()])
def test_help_cites_only_files_that_exist(name, parser):
    text = parser.format_help()
    for cited in CITED_FILE.findall(text):
        found = (helpers.ROOT / cited).exists() or any(
            p for p in helpers.ROOT.rglob(cited.rsplit("/", 1)[-1]) if ".git" not in p.parts)
        assert found, f"`{name} --help` cites {cited}, which is not in the repository"


def test_the_file_check_finds_a_missing_file():
    assert CITED_FILE.findall("kaggle | mlperf40m (REFERENCE.md lists), see data/schema.py; "
                              "writes curves.png") == ["REFERENCE.md", "data/schema.py"]
    assert not (helpers.ROOT / "REFERENCE.md").exists()


def test_version_prints_the_packages():
    r = subprocess.run([sys.executable, "-m", "one_embedding", "--version"], capture_output=True,
                       text=True, timeout=60, cwd=helpers.ROOT)
    assert r.returncode == 0 and r.stdout.strip() == f"one-embedding {oe.__version__}", r


def test_plan_offers_the_optimizers_train_does():
    (_, train), = [(n, p) for n, p in parsers() if n == "one-embedding train"]
    (_, plan), = [(n, p) for n, p in parsers() if n == "one-embedding plan"]

    def choices(parser):
        (action,) = [a for a in parser._actions if "--optimizer" in a.option_strings]
        return tuple(action.choices)

    assert choices(plan) == choices(train) == tuple(sorted(OPTIMIZERS))
