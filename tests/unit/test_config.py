"""TrainConfig: one place for every default, choice and bound; the CLI flags generated from it."""
import argparse
import dataclasses
import doctest
import re

import pytest

from one_embedding import cli, config
from one_embedding.bench import parse_store_specs
from one_embedding.config import TrainConfig
from one_embedding.errors import ConfigError

#: every flag `one-embedding train` and `bench` took before the config generated them
FLAGS_BEFORE = """--model --embedding-dim --bottom-mlp --top-mlp --dnn --cross-layers --cross --dropout
--data --synthetic-cardinalities --synthetic-scale --synthetic-rows --zipf-alpha --on-bad-line
--eval-fraction --store --engine --cache-mb --host-cache-mb --capacity --persistent-path
--batch-size --steps --epochs --optimizer --lr --warmup-steps --eval-interval --eval-batches
--snapshot-interval --snapshot-name --seed""".split()


def parse(command, *argv):
    args = cli.build_parser().parse_args([command, *map(str, argv)])
    return TrainConfig.from_args(args)


def flags_of(command, capsys):
    """The flags ``one-embedding COMMAND --help`` lists."""
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args([command, "--help"])
    return set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", capsys.readouterr().out))


def test_docstring_examples_run():
    assert doctest.testmod(config).failed == 0


@pytest.mark.parametrize("command", ["train", "bench"])
def test_every_field_is_a_flag_and_no_old_flag_is_lost(command, capsys):
    flags = flags_of(command, capsys)
    # bench decides the store, its path, evaluation and checkpoints itself: its help leaves
    # them out (it listed them with train's descriptions, then refused them)
    decided = set(cli._BENCH_SETS + cli._BENCH_RUN_SETS) if command == "bench" else set()
    assert set(FLAGS_BEFORE) - {"--" + n.replace("_", "-") for n in decided} <= flags
    for f in dataclasses.fields(TrainConfig):
        name = f.name.replace("_", "-")
        # a switch that is on by default is offered as its "off" form (--no-cuda-graph)
        flag = f"--no-{name}" if f.default is True else f"--{name}"
        assert f.name in decided or flag in flags, flag
    if decided:
        sub = next(a for a in cli.build_parser()._subparsers._group_actions
                   if isinstance(a, argparse._SubParsersAction)).choices[command]
        hidden = {a.dest for a in sub._actions if a.help == argparse.SUPPRESS}
        assert hidden == decided


@pytest.mark.parametrize("command", ["train", "bench"])
def test_cli_defaults_are_the_config_defaults(command):
    assert parse(command) == TrainConfig()


def test_defaults_where_the_old_dataclass_and_cli_disagreed_follow_the_cli():
    cfg = TrainConfig()
    assert cfg.steps is None and cfg.epochs == 1                   # one pass, as the CLI did
    assert cfg.bottom_mlp == (64, 32, 16)
    assert TrainConfig(embedding_dim=8).bottom_mlp == (64, 32, 8)  # 64,32,E follows E
    assert parse("train", "--embedding-dim", 8).bottom_mlp == (64, 32, 8)


def test_flags_parse_to_config_values():
    cfg = parse("train", "--model", "dcn", "--data", "a.tsv", "b.parquet", "--dnn", "32,16",
                "--cache-mb", 0.25, "--steps", 7, "--persistent-path", "/tmp/x", "--store",
                "cached_ssd", "--engine", "rocksdb", "--read-ahead", 0)
    assert cfg.model == "dcn" and cfg.data == ("a.tsv", "b.parquet") and cfg.dnn == (32, 16)
    assert cfg.cache_mb == 0.25 and cfg.steps == 7 and cfg.read_ahead == 0
    assert (cfg.store, cfg.engine, cfg.persistent_path) == ("cached_ssd", "rocksdb", "/tmp/x")


def test_config_is_frozen_and_replace_validates_again():
    cfg = TrainConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.steps = 5
    assert dataclasses.replace(cfg, steps=5).steps == 5
    with pytest.raises(ConfigError, match="steps=0"):
        dataclasses.replace(cfg, steps=0)


@pytest.mark.parametrize("kwargs, message", [
    (dict(model="xgboost"), r"model='xgboost' \(--model\): choose one of \('dlrm'"),
    (dict(optimizer="adamw"), r"optimizer='adamw' \(--optimizer\): choose one of"),
    (dict(store="ssd"), r"store='ssd' \(--store\): choose one of"),
    (dict(engine="lmdb"), r"engine='lmdb' \(--engine\): choose one of"),
    (dict(steps=0), r"steps=0 \(--steps\): use a value >= 1, or leave it unset"),
    (dict(batch_size=0), r"batch_size=0 \(--batch-size\): use a value >= 1"),
    (dict(batch_size=True), r"batch_size=True \(--batch-size\): pass an integer"),
    (dict(batch_size=8.5), r"batch_size=8.5 \(--batch-size\): pass an integer"),
    (dict(lr=float("nan")), r"lr=nan \(--lr\): pass a finite number"),
    (dict(lr=-1.0), r"lr=-1.0 \(--lr\): use a value >= 0.0"),
    (dict(batch_size=None), r"batch_size=None \(--batch-size\): this setting cannot be unset; its "
                            r"default is 1024"),  # lr=None is "the optimizer's" since issue 31
    (dict(eval_fraction=1.5), r"eval_fraction=1.5 \(--eval-fraction\): use a value <= 1.0"),
    (dict(synthetic_scale=0.0), r"synthetic_scale=0.0 .*: use a value > 0.0"),
    (dict(dnn=(64, 0)), r"dnn=\(64, 0\) \(--dnn\): every entry >= 1"),
    (dict(dnn=()), r"dnn=\(\) \(--dnn\): give at least one entry"),
    (dict(top_mlp="64,1"), r"top_mlp='64,1' \(--top-mlp\): pass a list of integers"),
    (dict(data=[]), r"data=\[\] \(--data\): give at least one entry"),
    (dict(embedding_dim=8, bottom_mlp=(16, 4)), r"bottom_mlp=\[16, 4\] must end in embedding_dim=8"),
    (dict(store="cached_ssd"), r"store='cached_ssd' needs --persistent-path"),
    (dict(warmup_steps=10, decay_steps=5, decay_start=3), r"decay_start=3 is before the end of the "
                                                          r"warmup \(warmup_steps=10\)"),
    (dict(optimizer="ftrl", warmup_steps=10), r"warmup_steps=10 with optimizer='ftrl': .* lr 0 "
                                              r".* use --warmup-steps 0"),
    (dict(ftrl_convention="tf"), r"ftrl_convention='tf' \(--ftrl-convention\): choose one of"),
])
def test_bad_values_name_the_value_the_flag_and_the_fix(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**kwargs)


def test_values_are_normalised_once():
    import pathlib

    cfg = TrainConfig(data=pathlib.Path("day_0.tsv"), persistent_path=pathlib.Path("/tmp/t"),
                      dnn=[8, 4], lr=1, cache_mb=2)
    assert cfg.data == ("day_0.tsv",) and cfg.persistent_path == "/tmp/t" and cfg.dnn == (8, 4)
    assert type(cfg.lr) is float and type(cfg.cache_mb) is float


def test_cli_reports_a_bad_config_without_a_traceback(capsys):
    assert cli.main(["train", "--steps", "0", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "steps=0 (--steps)" in err and "Traceback" not in err


def test_bench_store_specs_are_checked_before_any_training(tmp_path, capsys):
    assert parse_store_specs(["device_mem", "cached_ssd:rocksdb"]) == [
        ("device_mem", "device_mem", "slots"), ("cached_ssd:rocksdb", "cached_ssd", "rocksdb")]
    for spec in ("cached_ssd:lmdb", "host_mem", "device_mem:rocksdb"):
        with pytest.raises(ConfigError, match=f"--stores '{spec}'"):
            parse_store_specs([spec])
    # bench chooses the store and its path per run: a --store would be silently ignored
    assert cli.main(["bench", "--store", "cached_ssd", "--out", str(tmp_path)]) == 2
    assert "--store would be ignored" in capsys.readouterr().err
    # and the runs' evaluation and checkpoints: --resume asked for --persistent-path, which
    # was then refused in turn
    for flag in (["--resume"], ["--eval-interval", "5"], ["--keep-snapshots", "1"]):
        assert cli.main(["bench", *flag, "--out", str(tmp_path)]) == 2
        assert f"so {flag[0]} would be ignored: drop it" in capsys.readouterr().err


def test_add_arguments_works_on_any_parser():
    parser = argparse.ArgumentParser()
    TrainConfig.add_arguments(parser)
    assert TrainConfig.from_args(parser.parse_args(["--lr", "0.5"])).lr == 0.5


# --- numbers and names found bad by the fault campaign (issue 12): refused before any training ---

@pytest.mark.parametrize("argv, message", [
    (["--seed", "-1"], r"seed=-1 \(--seed\): use a value >= 0"),
    (["--seed", str(2**70)], rf"seed={2**70} \(--seed\): use a value <= {2**63 - 1}"),
    (["--steps", str(2**64)], rf"steps={2**64} \(--steps\): use a value <= {2**63 - 1}"),
    (["--cache-mb", "inf"], r"cache_mb=inf \(--cache-mb\): pass a finite number"),
    (["--cache-mb", "1e9"],
     r"cache_mb=1e\+09.*more than this machine's [\d,]+ MB of RAM.*--cache-mb \d+"),
    (["--cache-mb", "1", "--host-cache-mb", "1e9", "--store", "cached_ssd", "--persistent-path",
      "{tmp}/t"],
     r"cache_mb=1, host_cache_mb=1e\+09 \(--cache-mb \+ --host-cache-mb = .*more than"),
    (["--eval-interval", "-5"], r"eval_interval=-5 \(--eval-interval\): use a value >= 0"),
    (["--snapshot-interval", "-1"],
     r"snapshot_interval=-1 \(--snapshot-interval\): use a value >= 0"),
    (["--eval-fraction", "0"],
     r"eval_fraction=0.0 \(--eval-fraction\) holds out no rows.*e\.g\. 0\.05"),
    (["--eval-fraction", "1"], r"eval_fraction=1.0 \(--eval-fraction\) holds out every row"),
    (["--snapshot-name", "../x", "--persistent-path", "{tmp}/t"],
     r"--snapshot-name: snapshot name '\.\./x' is not allowed"),
    (["--snapshot-name", ".hidden", "--persistent-path", "{tmp}/t"],
     r"--snapshot-name: snapshot name '\.hidden' is not allowed"),
    (["--metrics", "{tmp}/missing/m.jsonl"], r"--metrics '.*/missing/m\.jsonl': its folder .* does "
                                             r"not exist: create it"),
    (["--metrics", "{tmp}"], r"--metrics '.*' is a folder: give a file in it"),
    # issue 29: a sketch beyond RAM (was numpy's _ArrayMemoryError), and options that act only
    # with another one (were silently ignored)
    (["--admit-min-count", "2", "--admit-sketch-mb", "1e9"],
     r"admit_sketch_mb=1e\+09 \(--admit-sketch-mb, MiB per rank\) is more than this machine's "
     r"[\d,]+ MB of RAM.*--admit-sketch-mb 32"),
    (["--admit-sketch-mb", "64"],
     r"admit_sketch_mb=64 \(--admit-sketch-mb\).*only --admit-min-count > 1 uses.*add "
     r"--admit-min-count N"),
    (["--admit-sketch-mb", "32", "--admit-min-count", "1"],  # given, even at the usual size
     r"admit_sketch_mb=32 \(--admit-sketch-mb\).*add --admit-min-count N"),
    (["--evict-interval", "5"],
     r"evict_interval=5 \(--evict-interval\).*only --steps-to-live > 0 runs.*add "
     r"--steps-to-live N"),
    (["--evict-interval", "5", "--max-rows", "1000"], r"evict_interval=5 .*add --steps-to-live N"),
    # a fault campaign's (2026-12-07): more settings silently ignored alone
    (["--cache-mb", "128"], r"cache_mb=128.0 \(--cache-mb\) sizes the device cache of the "
                            r"cached stores; --store device_mem keeps the whole table"),
    (["--engine", "rocksdb"], r"engine='rocksdb' \(--engine\) picks the SSD engine of --store "
                              r"cached_ssd; --store device_mem has none"),
    (["--store", "cached_host_mem", "--host-cache-mb", "5"],
     r"host_cache_mb=5.0 \(--host-cache-mb\).*--store cached_host_mem has none"),
    (["--data", "{tmp}/day_0.tsv", "--zipf-alpha", "1.2"],
     r"zipf_alpha=1.2 \(--zipf-alpha\) shapes the synthetic source's ids"),
    (["--data", "{tmp}/day_0.tsv", "--synthetic-scale", "0.5"],
     r"synthetic_scale=0.5 \(--synthetic-scale\)"),
    (["--dnn", "8"], r"dnn=\[8\] \(--dnn\) is the DCN / DeepFM deep part"),
    (["--model", "deepfm", "--cross-layers", "2"],
     r"cross_layers=2 \(--cross-layers\) counts DCN's cross layers; --model deepfm has none"),
    (["--decay-start", "5"], r"decay_start=5 \(--decay-start\).*only --decay-steps N > 0"),
    (["--keep-snapshots", "1"], r"keep_snapshots=1 \(--keep-snapshots\).*add --persistent-path"),
    (["--snapshot-name", "best"], r"snapshot_name='best' \(--snapshot-name\).*add "
                                  r"--persistent-path"),
    (["--snapshot-name", "step-5", "--persistent-path", "{tmp}/t"],
     r"snapshot_name='step-5' \(--snapshot-name\) is the name of an interval checkpoint"),
    # a second fault campaign's (2026-12-07)
    (["--data", "{tmp}/day_0.tsv", "--synthetic-rows", "5000"],
     r"synthetic_rows=5000 \(--synthetic-rows\) sizes the synthetic source"),
    (["--data", "{tmp}/day_0.tsv", "--synthetic-cardinalities", "mlperf40m"],
     r"synthetic_cardinalities='mlperf40m' \(--synthetic-cardinalities\)"),
    (["--frequency-half-life", "50"],
     r"frequency_half_life=50 \(--frequency-half-life\).*add --max-rows N"),
    (["--ftrl-convention", "tensorflow"],
     r"ftrl_convention='tensorflow' \(--ftrl-convention\).*add --optimizer ftrl"),
    (["--optimizer", "adam", "--ftrl-convention", "oneflow"],
     r"ftrl_convention='oneflow' \(--ftrl-convention\)"),
    (["--cross", "matrix"], r"cross='matrix' \(--cross\) picks DCN's cross layer; --model dlrm"),
    (["--dropout", "0.5"], r"dropout=0.5 \(--dropout\).*--model dlrm has none"),
    (["--model", "dcn", "--top-mlp", "8,1"], r"top_mlp=\[8, 1\] \(--top-mlp\) is DLRM's top "
                                              r"MLP; --model dcn has --dnn"),
    (["--model", "deepfm", "--bottom-mlp", "8,16"],
     r"bottom_mlp=\[8, 16\] \(--bottom-mlp\) is DLRM's bottom MLP"),
])
def test_cli_refuses_bad_numbers_and_names_before_training(argv, message, tmp_path, capsys,
                                                           monkeypatch):
    import one_embedding.training

    def no_training(*args, **kwargs):
        raise AssertionError("training started")

    monkeypatch.setattr(one_embedding.training, "train", no_training)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert cli.main(["train", "--steps", "2", "--no-progress", *argv]) == 2
    err = capsys.readouterr().err
    assert re.search(r"one-embedding train: error: " + message, err), err
    assert "Traceback" not in err
    assert not (tmp_path / "t").exists()  # nothing created on disk either


def test_config_refuses_a_cache_beyond_ram_and_names_the_ram(monkeypatch):
    monkeypatch.setattr(config, "physical_memory_mb", lambda: 1000.0)
    TrainConfig(cache_mb=600, host_cache_mb=300)
    with pytest.raises(ConfigError,
                       match=r"more than this machine's 1,000 MB of RAM.*--cache-mb 125"):
        TrainConfig(cache_mb=600, host_cache_mb=500)
    monkeypatch.setattr(config, "physical_memory_mb", lambda: None)  # the OS does not say
    TrainConfig(cache_mb=1e9)


def test_a_program_may_leave_other_models_and_sources_settings_in_its_config():
    """The CLI refuses a flag that acts only with another one; a TrainConfig built by a program
    (one config for several models, stores or sources) keeps them without a word."""
    cfg = TrainConfig(data=("day_0.tsv",), synthetic_scale=0.5, dnn=(8, 4), engine="rocksdb",
                      host_cache_mb=4)
    with pytest.raises(ConfigError, match=r"engine='rocksdb' \(--engine\)"):
        cfg.check_flags_act()


def test_seed_at_the_64_bit_limit_is_accepted():
    assert TrainConfig(seed=2**63 - 1).seed == 2**63 - 1


def test_options_that_need_another_one_are_accepted_with_it():
    """issue 29: what the combination errors ask for is accepted, and "unset" stays unset."""
    assert TrainConfig().admit_sketch_mb is None  # LifecycleOptions' default (32) applies
    assert parse("train", "--admit-min-count", "2", "--admit-sketch-mb", "8").admit_sketch_mb == 8
    assert parse("train", "--steps-to-live", "20", "--evict-interval", "5").evict_interval == 5
    from one_embedding.training_setup import lifecycle_options_for

    assert lifecycle_options_for(TrainConfig(admit_min_count=2)).sketch_mb == 32.0
    assert lifecycle_options_for(TrainConfig(admit_min_count=2, admit_sketch_mb=8)).sketch_mb == 8


def test_snapshot_interval_without_a_path_is_refused_before_training(tmp_path, capsys):
    """issue 29: --snapshot-interval wrote nothing without --persistent-path, silently."""
    metrics = tmp_path / "m.jsonl"
    assert cli.main(["train", "--steps", "2", "--no-progress", "--snapshot-interval", "1",
                     "--metrics", str(metrics)]) == 2
    err = capsys.readouterr().err
    assert re.search(r"one-embedding train: error: snapshot_interval=1 \(--snapshot-interval\) "
                     r"writes checkpoints into the run's folder, and there is none: add "
                     r"--persistent-path DIR", err), err
    assert "Traceback" not in err and not metrics.exists()  # refused before the first step


def test_a_config_saved_before_issue_29_still_builds_the_served_model():
    """Checkpoints written before issue 29 hold admit_sketch_mb 32.0 without admission (and
    may hold an --evict-interval without --steps-to-live, then ignored): ``serve`` rebuilds
    the model from that config, and must not refuse it (serving has no feature lifecycle)."""
    from one_embedding.serving.predictor import _serving_config

    saved = {**dataclasses.asdict(TrainConfig()), "admit_sketch_mb": 32.0, "evict_interval": 5}
    saved = json_round_trip(saved)
    cfg = _serving_config(saved)
    assert cfg.model == "dlrm" and cfg.admit_min_count == 1 and cfg.admit_sketch_mb is None


def json_round_trip(record):
    import json

    return json.loads(json.dumps(record))


def test_the_resume_command_after_ctrl_c_is_the_same_command_with_resume(monkeypatch, tmp_path):
    """issue 29: --overwrite (or a prefix argparse took for it) gives way to --resume, which is
    added once; a relative path says the folder to run it in; no checkpoint, no command."""
    import shlex

    from one_embedding.training import TrainingInterrupted

    monkeypatch.setattr("sys.argv", ["/usr/bin/one-embedding"])
    cfg = TrainConfig(persistent_path=str(tmp_path / "t"), steps=50, snapshot_interval=5)
    error = TrainingInterrupted(7, cfg.persistent_path, (5, "step-5"))
    argv = ["train", "--steps", "50", "--persistent-path", str(tmp_path / "t"), "--over"]
    text = cli._interrupted(error, cfg, argv)
    head, command = text.split("\n  ")
    assert head == (f"one-embedding train: interrupted at step 7; the last checkpoint saved is "
                    f"'step-5' (step 5) under {str(tmp_path / 't')!r}. Continue from it with:")
    assert shlex.split(command) == ["one-embedding", *argv[:-1], "--resume"]
    text = cli._interrupted(error, cfg, [*argv[:-1], "--res"])
    assert shlex.split(text.split("\n  ")[1]) == ["one-embedding", *argv[:-1], "--res"]
    monkeypatch.chdir(tmp_path)
    relative = TrainConfig(persistent_path="t", steps=50, snapshot_interval=5)
    assert f"Continue from it with (in {tmp_path}):" in cli._interrupted(error, relative, argv)
    none = TrainingInterrupted(3, cfg.persistent_path, None)
    assert cli._interrupted(none, cfg, argv) == (
        f"one-embedding train: interrupted at step 3; no checkpoint was saved under "
        f"{cfg.persistent_path!r} yet, so there is nothing to resume: start the run again")
