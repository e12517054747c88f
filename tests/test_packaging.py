"""The package installs from a wheel (non-editable) with `recipes/` and `callbacks/` mapped."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_non_editable_install_imports_from_another_directory(tmp_path):
    wheel_dir, target, elsewhere = tmp_path / "wheel", tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheel_dir), str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = wheel_dir.glob("trainwell-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"trainwell/recipes/resnet_imagenet.py", "trainwell/callbacks/checkpoint/__init__.py", "trainwell/runtime.py",
            "trainwell/data/embedded.py", "trainwell/models/resnet.py"} <= names
    assert not any(n.startswith(("recipes/", "callbacks/", "tests/")) for n in names)  # never top-level import names
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    # a user's own callbacks.py must not shadow ours
    (elsewhere / "callbacks.py").write_text("raise SystemExit('shadowed')\n")
    code = ("import trainwell, trainwell.recipes, trainwell.callbacks; "
            "from trainwell.callbacks import Checkpoint; from trainwell.recipes import resnet_imagenet; "
            "print(trainwell.__file__)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=elsewhere,
                       env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin", "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().startswith(str(target))
