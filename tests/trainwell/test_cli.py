import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trainwell import cli

TRAINWELL = str(Path(sys.executable).with_name("trainwell"))


def test_info_json(capsys):
    assert cli.main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert {"tensorflow", "keras"} <= set(info["versions"])
    assert info["embedded"]["mnist5k"] == "present"
    assert info["precision"]["auto"] == "float32"
    assert any(d.startswith("CPU") for d in info["devices"])


def _env_without_tf_log_settings():
    return {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", cli.TF_LOGS_ENV)}


@pytest.mark.slow
def test_info_via_console_script_without_tensorflow_start_up_lines():
    # TF 2.21 prints ~5 C++ lines at start on a machine without a GPU driver (absl's
    # notice, CUDA probes, "failed call to cuInit"), whatever TF_CPP_MIN_LOG_LEVEL says.
    r = subprocess.run([TRAINWELL, "info"], capture_output=True, text=True, timeout=120,
                       env=_env_without_tf_log_settings())
    assert r.returncode == 0, r.stderr
    assert "embedded data and models:" in r.stdout and "mnist5k" in r.stdout
    if not cli._has_gpu_driver():
        assert r.stderr == ""


def test_bad_input_via_console_script_is_exactly_one_line_and_exit_2(tmp_path):
    # A typo is reported before TensorFlow is imported (the transformer's config needs no TF).
    r = subprocess.run([TRAINWELL, "train", "transformer-finetune", "--set", "dataset=rotten-tomatoes"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path, env=_env_without_tf_log_settings())
    assert r.returncode == 2
    assert r.stderr == ("trainwell: error: Invalid value for `dataset`: expected 'rotten_tomatoes', 'csv:PATH', "
                        "'jsonl:PATH' or 'tfds:NAME'. Did you mean 'rotten_tomatoes'? Received: dataset='rotten-tomatoes'\n")
    assert r.stdout == "" and list(tmp_path.iterdir()) == []


def test_start_up_filter_drops_only_the_known_noise(tmp_path):
    # A stand-in `tensorflow` that writes to fd 2 from "C++" as TF 2.21 does on a CPU machine,
    # plus one line that is not start-up noise and must survive.
    (tmp_path / "tensorflow").mkdir()
    (tmp_path / "tensorflow" / "__init__.py").write_text(textwrap.dedent("""
        import os, types
        os.write(2, b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\\n"
                    b"I0000 00:00:17.1 1 cudart_stub.cc:31] Could not find cuda drivers on your machine.\\n"
                    b"I0000 00:00:17.2 1 cpu_feature_guard.cc:227] This TensorFlow binary is optimized ...\\n"
                    b"To enable the following instructions: AVX2 FMA, in other operations, rebuild ...\\n"
                    b"W0000 00:00:17.3 1 something.cc:1] a real warning\\n")
        _probed = []
        def _probe(kind):  # CUDA is probed once per process
            if not _probed:
                os.write(2, b"E0000 00:00:17.4 1 cuda_platform.cc:52] failed call to cuInit: CUDA error (303)\\n")
            _probed.append(kind)
            return []
        config = types.SimpleNamespace(list_physical_devices=_probe)
    """))
    code = ("from trainwell import cli; cli.start_tensorflow_quietly(); "
            "import tensorflow as tf; tf.config.list_physical_devices('GPU')")
    env = {**_env_without_tf_log_settings(), "PYTHONPATH": str(tmp_path)}
    quiet = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    loud = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**env, cli.TF_LOGS_ENV: "1"})
    assert quiet.returncode == loud.returncode == 0, quiet.stderr + loud.stderr
    assert len(loud.stderr.splitlines()) == 6  # the switch shows everything
    if cli._has_gpu_driver():  # a GPU machine: nothing is filtered, a real CUDA error shows
        assert quiet.stderr == loud.stderr
    else:
        assert quiet.stderr == "W0000 00:00:17.3 1 something.cc:1] a real warning\n"


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["train"])  # missing RECIPE
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        cli.main(["frobnicate"])
    assert e.value.code == 2


def test_unknown_recipe_exit_2(capsys):
    assert cli.main(["train", "vgg-cifar"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Unknown recipe 'vgg-cifar'" in err and "Traceback" not in err


def test_exit_status_3_and_not_built_paths_are_gone():
    assert not hasattr(cli, "NotBuiltError") and not hasattr(cli, "EXIT_NOT_BUILT")


@pytest.mark.parametrize(
    "manifest, says",
    [
        (None, "no manifest.json"),
        (b'{"recipe": "nope"}', "names no known recipe"),
        (b'{"recipe": "resnet-imagenet-x"}', "Did you mean 'resnet-imagenet'?"),
        (b'{"recipe": 5}', "Received: recipe=5"),
        (b'{"recipe": "resnet-imagenet", "config": "epochs: 3"}', "its `config` must be a mapping"),
        (b'{"recipe": "resnet-imagenet", "config": [1, 2]}', "Received: list"),
        (b'[1, 2]', "expected a JSON object. Received: list"),
        (b'"a string"', "expected a JSON object. Received: str"),
        (b'{"recipe": "resnet-imagenet", "conf', "not valid JSON"),
        ('{"recipe": "resnet-imagenet", "host": "caf\xe9"}'.encode("latin-1"), "not UTF-8 text"),
        (b"[" * 100_000, "nested too deeply"),
        (b'{"recipe": "resnet-imagenet", "config": {"dataset": "digits", "epochs": "x"}}', "Received: epochs='x'"),
        (b'{"recipe": "resnet-imagenet", "config": {"dataset": "digits", "nope": 1}}', "Unknown config key `nope`"),
    ],
    ids=["missing", "unknown recipe", "recipe typo", "recipe not a string", "string config", "list config",
         "list", "string", "truncated", "Latin-1", "deep", "bad value", "unknown key"],
)
def test_a_damaged_manifest_on_resume_is_one_line_exit_2(manifest, says, tmp_path, capsys):
    if manifest is not None:
        (tmp_path / "manifest.json").write_bytes(manifest)
    assert cli.main(["resume", str(tmp_path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err


def test_ctrl_c_names_the_last_checkpoint_and_the_command_that_continues(tmp_path, monkeypatch, capsys):
    from trainwell.recipes import resnet_imagenet

    run_dir = tmp_path / "run"
    assert cli.main(["train", "resnet-imagenet", "--set", "dataset=digits", "--set", "image_size=8", "--set",
                     "model=resnet18", "--set", "width=4", "--set", "epochs=1", "--set", "verbose=0", "--set",
                     "doctor=false", "--set", f"run_dir={run_dir}"]) == 0
    capsys.readouterr()

    def interrupted(cfg):
        raise KeyboardInterrupt  # what Ctrl-C raises inside fit

    monkeypatch.setattr(resnet_imagenet, "train", interrupted)
    assert cli.main(["resume", str(run_dir), "--set", "epochs=2"]) == 130
    err = capsys.readouterr().err
    assert "keeps its last checkpoint (ckpt-" in err and f"`trainwell resume {run_dir}` continues" in err, err
    assert err.strip().endswith("trainwell: interrupted")


def test_resume_of_a_url_whose_server_cannot_be_reached_is_one_line_exit_2(monkeypatch, capsys):
    # nothing listens on port 9 of this machine; it was botocore's traceback of 140 lines
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "a")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "b")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    assert cli.main(["resume", "s3://bucket/runs/x", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Cannot read the run at 's3://bucket/runs/x'" in err, err
    # a dry run checks what the run's setup checks first: the bucket, reachable
    assert cli.main(["train", "resnet-imagenet", "--set", "dataset=digits", "--set", "run_dir=s3://bucket/r",
                     "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "expected a reachable bucket (EndpointConnectionError" in err, err


@pytest.mark.parametrize(
    "args, says",
    [
        (["--max-trials", "0"], "--max-trials: expected an integer >= 1. Received: '0'"),
        (["--population-size", "-2"], "--population-size: expected an integer >= 2. Received: '-2'"),
        (["--max-epochs", "0"], "--max-epochs: expected an integer >= 1. Received: '0'"),
        (["--ready-interval", "x"], "--ready-interval: expected an integer >= 1. Received: 'x'"),
        (["--workers", "-1"], "--workers: expected an integer >= 0"),
        (["--timeout", "nan"], "--timeout: expected a number of seconds > 0"),
        (["--oracle-port", "70000"], "--oracle-port: expected an integer in [1, 65535]"),
        (["--seed", str(2**70)], "--seed: expected an integer in [0, 4294967295]"),
    ],
)
def test_tune_arguments_are_checked_by_the_parser(args, says, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["tune", "resnet-imagenet", *args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err, err


def test_a_data_error_during_the_run_is_one_line_exit_2(monkeypatch, capsys):
    # What the config cannot see (e.g. a TFRecord shard that turns out empty) is a DataError
    # raised by the data loaders while the run starts: the command still ends in one line.
    from trainwell.data import DataError
    from trainwell.recipes import resnet_imagenet

    def train(cfg):
        raise DataError("The training split of 'tfrecord:/data/train-*' is empty.\nsecond line")

    monkeypatch.setattr(resnet_imagenet, "train", train)
    assert cli.main(["train", "resnet-imagenet", "--set", "dataset=digits"]) == 2
    assert capsys.readouterr().err == "trainwell: error: The training split of 'tfrecord:/data/train-*' is empty.\n"


def test_lr_find_method_choices_are_the_lr_finders_suggestions():
    # The parser lists them itself (building it must not import Keras); they must not drift.
    import argparse

    from trainwell.callbacks import lr_finder
    from trainwell.cli import CLI_METHOD, build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    method = next(a for a in sub.choices["lr-find"]._actions if a.dest == "method")
    assert set(method.choices) == set(lr_finder.METHODS)
    assert CLI_METHOD in method.choices


def test_lr_find_takes_verbose_for_its_progress():
    from trainwell.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["lr-find", "resnet-imagenet"]).verbose == 1
    assert parser.parse_args(["lr-find", "resnet-imagenet", "--verbose", "2"]).verbose == 2
    with pytest.raises(SystemExit):
        parser.parse_args(["lr-find", "resnet-imagenet", "--verbose", "5"])


def test_lr_find_runs_on_the_transformer_recipe(tmp_path, tiny_bert_preset, monkeypatch, capsys):
    # `trainwell lr-find transformer-finetune` ended in "TypeError: build_data() missing 1 required
    # positional argument: 'preprocessor'": the recipe now has `lr_find_setup`.
    import csv

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRAINWELL_QUICK", "1")  # 10 range-test steps, 10 per probe
    pos, neg, fill = ["good", "great", "fun"], ["bad", "dull", "weak"], ["the", "film", "was", "a"]
    preset = tiny_bert_preset(tmp_path / "preset", pos + neg + fill, 16)
    with open(tmp_path / "data.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["text", "label"])
        w.writerows([f"the film was {word}", "pos" if word in pos else "neg"] for word in (pos + neg) * 8)
    run = tmp_path / "lr"
    rc = cli.main(["lr-find", "transformer-finetune", "--verbose", "0", "--set", f"preset={preset}",
                   "--set", f"dataset=csv:{tmp_path / 'data.csv'}", "--set", "sequence_length=16",
                   "--set", "batch_size=8", "--set", f"run_dir={run}"])
    out = capsys.readouterr().out
    assert rc in (0, 1), out  # 1: ten steps may not tell a learning rate from noise; it ran either way
    assert json.loads((run / "lr_find.json").read_text())["lrs"], out
    assert ("Suggested peak learning rate" in out and "To train with it: --set peak_lr=" in out) or (
        "No reliable learning rate" in out), out


@pytest.mark.parametrize("checkpoint", [None, {"name": "ckpt-9", "path": "x", "position": {"epoch": 1}}],
                         ids=["no checkpoint", "checkpoint"])
def test_a_run_that_diverges_ends_in_its_message_and_exit_3(checkpoint, tmp_path, monkeypatch, capsys):
    # It was a Python traceback and exit 1 (`--set image_size=1` diverged past max_rollbacks).
    from trainwell.callbacks import checkpoint as ckpt
    from trainwell.callbacks.nan_rollback import TrainingDivergedError
    from trainwell.recipes import resnet_imagenet

    message = ("Training diverged at step 16 (loss_spike) and 3 rollback(s) within the whole run already reached "
               "max_rollbacks=3. The model holds the last good state (step 12, LR 0.05). Lower the learning rate, "
               "or check the input data.")

    def train(cfg):
        raise TrainingDivergedError(message)

    monkeypatch.setattr(resnet_imagenet, "train", train)
    monkeypatch.setattr(ckpt, "resume_checkpoint", lambda d: checkpoint)
    run = tmp_path / "run"
    assert cli.main(["train", "resnet-imagenet", "--set", "dataset=digits", "--set", "base_lr=0.2",
                     "--set", f"run_dir={run}"]) == cli.EXIT_DIVERGED == 3
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert lines[0] == f"trainwell: error: {message}" and len(lines) == 2 and "Traceback" not in err, err
    if checkpoint is None:
        assert lines[1] == "trainwell: no checkpoint was written; start again with --set base_lr=0.02."
    else:
        assert lines[1] == (f"trainwell: the run directory {run} keeps its last checkpoint (ckpt-9, after epoch 1): "
                            f"`trainwell resume {run} --set base_lr=0.02` continues from it with a tenth of the "
                            "learning rate.")
    # Any other error of the run is still the run's failure, with its traceback (exit 1 via the exception).
    monkeypatch.setattr(resnet_imagenet, "train", lambda cfg: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        cli.main(["train", "resnet-imagenet", "--set", "dataset=digits"])


def test_tune_prints_the_best_config_under_the_names_a_user_sets(tmp_path, monkeypatch, capsys):
    # The search's names (`peak_lr`, `warmup_fraction`) are not the ResNet config's fields: the best
    # trial's config (`SearchResult.best_config`, tested in tests/trainwell/tuning) is printed as `--set`s.
    from trainwell import tuning
    from trainwell.recipes import resnet_imagenet

    base = ["dataset=digits", "model=resnet18", "width=4", "epochs=6", "batch_size=128"]
    best = resnet_imagenet.Config.load(overrides=base + ["base_lr=0.0125", "warmup_epochs=0.5", "batch_size=256"])
    monkeypatch.setattr(tuning, "search", lambda *a, **k: tuning.SearchResult(
        None, {"peak_lr": 0.00625}, "00", 0.5, [], tmp_path, {}, best_config=best))
    argv = ["tune", "resnet-imagenet", "--max-trials", "1", "--directory", str(tmp_path)]
    assert cli.main(argv + [a for s in base for a in ("--set", s)]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert line == ("The best trial's config: --set batch_size=256 --set zero_init_residual=true --set base_lr=0.0125 "
                    "--set warmup_epochs=0.5"), line
    sets = line[len("The best trial's config: "):].split()[1::2]
    assert resnet_imagenet.Config.load(overrides=base + sets) == best  # what it prints gives that config back
