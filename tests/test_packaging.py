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
            "trainwell/data/embedded.py", "trainwell/models/resnet.py", "trainwell/cli/lr_find.py",
            "trainwell/cli/__main__.py"} <= names
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
    # An editor finds each public name's definition in the installed wheel too.
    found = resolve_statically(elsewhere, env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"})
    for code, rel in STATIC_NAMES.items():
        wheel_rel = rel if rel.startswith("trainwell/") else f"trainwell/{rel}"
        assert found[code] == [str(target / wheel_rel)], code


# --------------------------------------------------------------------------- static analysis
# What an editor resolves (jedi, as IPython and editors use it): the definition's file of each name.
STATIC_NAMES = {
    "from trainwell.callbacks import Checkpoint\nCheckpoint": "callbacks/checkpoint/callback.py",
    "from trainwell.callbacks import NaNRollback\nNaNRollback": "callbacks/nan_rollback.py",
    "from trainwell.callbacks.checkpoint import Checkpoint\nCheckpoint": "callbacks/checkpoint/callback.py",
    "from trainwell.recipes import resnet_imagenet\nresnet_imagenet.train": "recipes/resnet_imagenet.py",
    "from trainwell.tuning import search\nsearch": "trainwell/tuning/search.py",
    "import trainwell\ntrainwell.lr_find": "callbacks/lr_finder.py",
    "from trainwell.models import build_resnet\nbuild_resnet": "trainwell/models/resnet.py",
}

_RESOLVE = """
import json, sys, jedi
env = jedi.create_environment(sys.executable, safe=False)
out = {}
for code in json.loads(sys.argv[1]):
    last = code.splitlines()[-1]
    found = jedi.Script(code, environment=env).goto(code.count("\\n") + 1, len(last), follow_imports=True)
    out[code] = [str(d.module_path) for d in found if d.module_path]
print(json.dumps(out))
"""


def resolve_statically(cwd, env=None) -> dict:
    import json

    r = subprocess.run([sys.executable, "-c", _RESOLVE, json.dumps(list(STATIC_NAMES))], capture_output=True,
                       text=True, timeout=300, cwd=cwd, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_public_names_resolve_statically_in_the_editable_install(tmp_path):
    """`make` installs trainwell editable: an editor finds the definition of each public name in this checkout.

    setuptools' editable finder maps `trainwell.callbacks` / `trainwell.recipes` to the top-level folders at
    import time only; the links `trainwell/callbacks` and `trainwell/recipes` let static analysis follow them.
    """
    found = resolve_statically(tmp_path)
    for code, rel in STATIC_NAMES.items():
        assert [Path(p).resolve() for p in found[code]] == [ROOT / rel], code


def _type_checking_names(init: Path) -> set:
    import ast

    names = set()
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            names |= {a.asname or a.name for n in node.body if isinstance(n, ast.ImportFrom) for a in n.names}
    return names


@pytest.mark.parametrize("package", ["trainwell", "trainwell.callbacks", "trainwell.models"])
def test_lazy_names_are_named_for_static_analysis_too(package):
    """Each name a package hands out through `__getattr__` is also imported under `TYPE_CHECKING`."""
    import importlib

    module = importlib.import_module(package)
    lazy = set(getattr(module, "_LAZY", {})) | set(getattr(module, "_LAZY_FUNCS", {}))
    assert lazy and _type_checking_names(Path(module.__file__)) == lazy
