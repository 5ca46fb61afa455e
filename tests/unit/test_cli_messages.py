"""Error lines that name what is wrong in the CLI's own words (found by a fault campaign: a file
given where a run's folder goes was "does not exist" or "holds no snapshots/ folder", a
negative --rows was taken, and a bad line's advice named only the Python argument)."""
import pytest

from one_embedding import cli
from one_embedding.errors import ConfigError


@pytest.mark.parametrize("kind", ["missing", "file"])
def test_inspect_and_serve_name_a_missing_path_or_a_file(tmp_path, capsys, kind):
    path = tmp_path / "run"
    if kind == "file":
        path.write_text("not a run")
    said = "does not exist" if kind == "missing" else "is a file"
    assert cli.main(["inspect", str(path)]) == 2
    assert f"{str(path)!r} {said}: pass a run's --persistent-path" in capsys.readouterr().err
    pytest.importorskip("uvicorn")
    pytest.importorskip("starlette")
    pytest.importorskip("prometheus_client")
    assert cli.main(["serve", "--persistent-path", str(path)]) == 2
    assert f"{str(path)!r} {said}: pass the --persistent-path folder" in capsys.readouterr().err


def test_inspect_refuses_a_negative_row_count(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["inspect", str(tmp_path), "--rows", "-1"])
    assert e.value.code == 2
    assert "'-1' must be a whole number of rows >= 0" in capsys.readouterr().err


def test_inspect_refuses_sample_rows_the_summary_would_not_show(tmp_path, capsys):
    """--rows sets the --json output's sample rows; with the summary it was silently ignored."""
    assert cli.main(["inspect", str(tmp_path), "--rows", "2"]) == 2
    assert "--rows 2 sets the sample rows of the --json output" in capsys.readouterr().err


def test_the_programs_help_has_no_markup(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert "one-embedding train | bench" in out and "``" not in out


def test_a_bad_line_names_the_cli_flag_that_skips_it(tmp_path, capsys):
    bad = tmp_path / "day_0.tsv"
    bad.write_text("x\ty\n")
    assert cli.main(["train", "--data", str(bad), "--steps", "1", "--no-progress"]) == 2
    assert "(--on-bad-line skip)" in capsys.readouterr().err


def test_a_launched_job_without_mpi4py_says_so_once_and_exits_2(monkeypatch, capsys):
    """Under a system mpiexec with no mpi4py the clear message was followed by a traceback of
    the same error and exit status 1: ending the job tried to build the MPI communicator again
    (found by a fault campaign)."""
    from one_embedding.parallel import comm

    def no_mpi():
        raise ConfigError("several ranks need mpi4py: pip install 'one_embedding[mpi]'")

    monkeypatch.setattr(comm, "launched_world_size", lambda: 2)
    monkeypatch.setattr(comm, "default_comm", no_mpi)
    assert cli.main(["train", "--steps", "2", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "several ranks need mpi4py" in err and "Traceback" not in err
