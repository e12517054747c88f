import json
import os
import subprocess
import sys
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


def test_info_human_readable_via_console_script():
    r = subprocess.run([TRAINWELL, "info"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert r.returncode == 0, r.stderr
    assert "embedded data and models:" in r.stdout and "mnist5k" in r.stdout


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


@pytest.mark.parametrize("argv", [["tune", "resnet-imagenet"], ["lr-find", "resnet-imagenet"]])
def test_not_built_yet_is_plain_and_nonzero(argv, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    hidden = {"trainwell.tuning", "trainwell.callbacks.lr_finder"}
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n in hidden else real(n, *a))
    assert cli.main(argv) == 3
    assert "not built yet" in capsys.readouterr().err


def test_resume_errors(tmp_path, capsys):
    assert cli.main(["resume", str(tmp_path)]) == 2
    assert "no manifest.json" in capsys.readouterr().err
    (tmp_path / "manifest.json").write_text(json.dumps({"recipe": "nope"}))
    assert cli.main(["resume", str(tmp_path)]) == 2
    assert "names no known recipe" in capsys.readouterr().err


def test_lr_find_method_choices_are_the_lr_finders_suggestions():
    # The parser lists them itself (building it must not import Keras); they must not drift.
    import argparse

    from trainwell.callbacks import lr_finder
    from trainwell.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    method = next(a for a in sub.choices["lr-find"]._actions if a.dest == "method")
    assert set(method.choices) == set(lr_finder.METHODS)
    assert lr_finder.CLI_METHOD in method.choices
