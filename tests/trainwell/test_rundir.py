import json
import os

import pytest

from trainwell import rundir, runtime


def test_run_dir_and_manifest(tmp_path):
    from trainwell.config import BaseConfig

    d = rundir.make_run_dir(None, prefix="demo", root=str(tmp_path))
    d2 = rundir.make_run_dir(None, prefix="demo", root=str(tmp_path))
    assert d.is_dir() and d2.is_dir() and d != d2 and d.name.startswith("demo-")
    cfg = BaseConfig(epochs=2, seed=3)
    path = rundir.write_manifest(d, cfg, strategy=runtime.make_strategy("auto"), precision="float32",
                                  seed=3, recipe="resnet-imagenet")
    m = json.loads(path.read_text())
    assert m["recipe"] == "resnet-imagenet" and m["seed"] == 3 and m["precision"] == "float32"
    assert m["num_replicas"] == 1 and m["config"]["epochs"] == 2
    assert {"tensorflow", "keras", "python"} <= set(m["versions"])
    assert any(dev["type"] == "CPU" for dev in m["devices"])
    assert m["command"] and m["git_commit"] is None or isinstance(m["git_commit"], str)
    import yaml

    assert yaml.safe_load((d / "config.yaml").read_text())["epochs"] == 2
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        rundir.make_run_dir(f)


def test_git_commit(tmp_path):
    assert rundir.git_commit(tmp_path) is None
    os.system(f"cd {tmp_path} && git init -q && git -c user.email=a@b -c user.name=a commit -q --allow-empty -m x")
    sha = rundir.git_commit(tmp_path)
    assert sha and len(sha.split("+")[0]) == 40


def test_a_shared_run_dir_a_worker_cannot_make_is_one_line(tmp_path, monkeypatch):
    # A worker other than the chief makes the chief's directory under `root`: here a file.
    monkeypatch.setattr(rundir, "num_workers", lambda strategy: 2)
    monkeypatch.setattr(rundir, "is_chief", lambda strategy: False)
    monkeypatch.setattr(rundir, "broadcast_from_chief", lambda strategy, values: [20261204053000, 0])
    (tmp_path / "runs").write_text("a file")
    with pytest.raises(rundir.ConfigError) as info:
        rundir.shared_run_dir(None, strategy=object(), root=str(tmp_path / "runs"))
    msg = str(info.value)
    assert "\n" not in msg and "run-20261204-053000" in msg and "is a file, not a directory" in msg
    assert rundir.shared_run_dir(None, strategy=object(), root=str(tmp_path / "ok")).is_dir()
