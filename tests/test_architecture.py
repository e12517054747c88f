"""The import contract of docs/architecture.md, read from the code itself (AST, no import).

Four floors; imports only go down a floor or stay on it:

    0 foundation     trainwell.{config, io, runtime, rundir, validation, data, models, optimizers, losses, compat, ...}
    1 callbacks      trainwell.callbacks
    2 recipes        trainwell.recipes
    3 orchestration  trainwell.{tuning (with pbt), launch, cli}

`trainwell/__init__.py` is the facade: it may reach any floor lazily, and no module of
the package imports a name from it (`from trainwell import runtime`, a submodule, is fine).

The rules, each checked for every module of the package:

- back-edge: an import (at module level or inside a function) of a higher floor;
- facade: `from trainwell import NAME` where NAME is not a submodule;
- cycle: modules that import each other, directly or through others (any import);
- private: outside the seam `trainwell.compat`, `keras.src`, `keras_tuner.src`, `keras_hub.src`,
  `tensorflow.python` imported; `obj._name` read on an object other than `self`/`cls`
  where `_name` is a private name Keras, KerasTuner or `tf.distribute` define; a
  `__internal__` namespace (`tf.__internal__`); or, in a class with bases, a private
  *method* of theirs overridden (`def _apply_weight_decay(self, ...)`) or called on
  `self`/`super()` (a rename upstream would silently skip an override);
- local-import: an import inside a function without a comment saying why (on its line,
  on the first import of its run, on a comment line above the run, or on the `try:` guarding it);
- backend-branch: outside the seam `trainwell.compat`, code that asks which Keras backend
  runs in order to act differently. What differs between TensorFlow and JAX is a compat
  call (docs/backends.md). A breach is, in code (docstrings, comments and messages are
  text, not code, and never count):
  - `import jax` / `from jax... import ...`, at module level or in a function;
  - a call of `keras.backend.backend()` or `keras.config.backend()` (any use: the name
    of the backend, e.g. for a manifest, is `trainwell.compat.backend_name()`);
  - a call of compat's `is_jax()` (a bool whose only use is a branch);
  - a call of compat's `backend_name()` inside a condition (the test of an `if`,
    `while`, conditional expression, `assert` or comprehension filter) or a comparison;
    recording it (the run manifest) is not a branch;
  - reading `KERAS_BACKEND` from this process's environment (`os.environ[...]`,
    `os.environ.get`, `os.getenv`, `in os.environ`). Reading it from a mapping that
    is not `os.environ` is not: `trainwell.launch` reads the *workers'* environment it
    composes, a fact about other processes, not a branch of this one; setting it is
    not a read either.
  The checker reads expressions, not data flow: `b = backend_name()` then `if b == ...`
  passes it; a review catches that.

A violation accepted for a while goes in KNOWN with its reason, one strict xfail per
(rule, file), so it flips to a failure once fixed and its entry must then be deleted.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import re
import textwrap
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Source folder -> import name (pyproject's package-dir).
PACKAGE_DIRS = {"trainwell": "trainwell", "callbacks": "trainwell.callbacks", "recipes": "trainwell.recipes"}

FACADE = "trainwell"
SEAM = "trainwell.compat"
#: Floor of each module, by the longest matching prefix. A new top-level module must be
#: placed here (and in docs/architecture.md): the test fails on a module with no floor.
FLOORS = {
    "trainwell.config": 0, "trainwell.io": 0, "trainwell.runtime": 0, "trainwell.rundir": 0, "trainwell.storage": 0,
    "trainwell.validation": 0, "trainwell.data": 0, "trainwell.models": 0, "trainwell.optimizers": 0,
    "trainwell.losses": 0,
    "trainwell.compat": 0, "trainwell.quick": 0,
    "trainwell.callbacks": 1,
    "trainwell.recipes": 2,
    "trainwell.tuning": 3, "trainwell.launch": 3, "trainwell.cli": 3,
}

#: Violations accepted for now, as (rule, file relative to the repository), each with its reason.
#: Each is a strict xfail below: once it passes (XPASS fails the run), delete its entry.
KNOWN: set = set()


# --------------------------------------------------------------------------- reading the code
def module_files(root: Path = ROOT, package_dirs: dict = PACKAGE_DIRS) -> dict[str, Path]:
    """`{module name: file}` for every module of the package."""
    out = {}
    for folder, name in package_dirs.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([name, *parts])] = path
    return out


def floor_of(module: str, floors: dict = FLOORS) -> int | None:
    best = max((p for p in floors if module == p or module.startswith(p + ".")), key=len, default=None)
    return None if best is None else floors[best]


class Import:
    """One import statement's target inside the package, or of a private upstream module."""

    def __init__(self, target: str, line: int, local: bool, names: tuple = ()):
        self.target, self.line, self.local, self.names = target, line, local, names


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def read_imports(module: str, path: Path, modules: set) -> tuple[list[Import], ast.Module, list[str]]:
    """The imports of one module (package targets resolved to modules), its tree and its lines."""
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source)
    is_package = path.name == "__init__.py"
    out = []

    def visit(node, local):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                continue
            inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for a in child.names:
                    out.append(Import(a.name, child.lineno, local))
            elif isinstance(child, ast.ImportFrom):
                target = _resolve(module, is_package, child)
                names = tuple(a.name for a in child.names)
                subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in modules]
                for s in subs:  # `from pkg import submodule`: an edge to the submodule
                    out.append(Import(s, child.lineno, local))
                if len(subs) < len(names):
                    out.append(Import(target, child.lineno, local, tuple(n for n in names if f"{target}.{n}" not in modules)))
            visit(child, inner)

    visit(tree, False)
    return out, tree, source.splitlines()


def _is_type_checking(test) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


_PRIVATE_DEF = re.compile(r"(?:\bdef\s+|\bself\.|^\s*)(_[A-Za-z]\w*)\s*(?:\(|=|:)", re.M)
_PRIVATE_METHOD = re.compile(r"^\s+def\s+(_[A-Za-z]\w*)\s*\(\s*self\b", re.M)
_UPSTREAM = (("keras", ("src",)), ("keras_tuner", ("src",)), ("tensorflow", ("python", "distribute")))


@functools.lru_cache(maxsize=1)
def _scan_upstream() -> tuple[frozenset, frozenset]:
    names, methods = set(), set()
    for package, sub in _UPSTREAM:
        spec = importlib.util.find_spec(package)  # finds the folder without importing the package
        if spec is None or not spec.submodule_search_locations:
            continue
        folder = Path(list(spec.submodule_search_locations)[0]).joinpath(*sub)
        for path in folder.rglob("*.py"):
            if "test" in path.name:
                continue
            text = path.read_text(encoding="utf-8", errors="ignore")
            names.update(m.group(1) for m in _PRIVATE_DEF.finditer(text) if not m.group(1).startswith("__"))
            methods.update(m.group(1) for m in _PRIVATE_METHOD.finditer(text) if not m.group(1).startswith("__"))
    return frozenset(names), frozenset(methods)


def upstream_private_names() -> frozenset:
    """Private names (`_x`, not dunder) that Keras, KerasTuner and `tf.distribute` define, from their sources."""
    return _scan_upstream()[0]


def upstream_private_methods() -> frozenset:
    """Private method names (`def _x(self`) of Keras, KerasTuner and `tf.distribute` classes."""
    return _scan_upstream()[1]


PRIVATE_MODULES = ("keras.src", "keras_tuner.src", "keras_hub.src", "tensorflow.python")


# --------------------------------------------------------------------------- the rules
def violations(root: Path = ROOT, package_dirs: dict = PACKAGE_DIRS, floors: dict = FLOORS,
               private_names: frozenset | None = None,
               private_methods: frozenset | None = None) -> list[tuple[str, str, str]]:
    """Every breach of the contract: `(rule, file relative to root, what)`."""
    files = module_files(root, package_dirs)
    modules = set(files)
    private_names = upstream_private_names() if private_names is None else private_names
    private_methods = upstream_private_methods() if private_methods is None else private_methods
    found = []
    graph = defaultdict(set)
    for module, path in files.items():
        rel = path.relative_to(root).as_posix()
        own = floor_of(module, floors)
        if own is None and module != FACADE:
            found.append(("floor", rel, f"{module} has no floor: add it to FLOORS and docs/architecture.md"))
            continue
        imports, tree, lines = read_imports(module, path, modules)
        in_seam = module == SEAM or module.startswith(SEAM + ".")
        for imp in imports:
            if imp.target.startswith(PRIVATE_MODULES) and not in_seam:
                found.append(("private", rel, f"line {imp.line}: imports {imp.target}"))
            if imp.target not in modules and not imp.target.startswith("trainwell"):
                continue
            if imp.target == FACADE and module != FACADE:
                if imp.names:
                    found.append(("facade", rel, f"line {imp.line}: imports {', '.join(imp.names)} from the facade"))
                continue
            target = imp.target
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            if module != FACADE and target != module:
                graph[module].add(target)
                theirs = floor_of(target, floors)
                if own is not None and theirs is not None and theirs > own:
                    how = "inside a function" if imp.local else "at module level"
                    found.append(("back-edge", rel, f"line {imp.line}: floor {own} imports {target} (floor {theirs}) {how}"))
        found += [("local-import", rel, what) for what in _uncommented_local_imports(tree, lines)]
        if not in_seam:
            found += [("backend-branch", rel, what) for what in _backend_branches(tree)]
            found += [("private", rel, what) for what in _private_attributes(tree, private_names)]
            found += [("private", rel, what) for what in _private_methods_of_bases(tree, private_methods)]
    for cycle in _cycles(graph):
        for m in cycle:
            found.append(("cycle", files[m].relative_to(root).as_posix(), "modules importing each other: " + ", ".join(cycle)))
    return found


def _uncommented_local_imports(tree, lines) -> list[str]:
    out = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        imports = [n for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))]
        import_lines = {i for n in imports for i in range(n.lineno, n.end_lineno + 1)}
        for node in imports:
            if any("#" in lines[i - 1] for i in range(node.lineno, node.end_lineno + 1)):
                continue
            above = node.lineno - 1  # 1-based line above; a run of imports shares one comment
            covered = False
            while above >= 1 and not covered:
                if above in import_lines:  # the run's first import may carry the comment on its line
                    covered = "#" in lines[above - 1]
                elif not (lines[above - 1].strip() == "" and above - 1 in import_lines):
                    break
                above -= 1
            opener = lines[above - 1].strip() if above >= 1 else ""
            # a comment line above the run, or on the `try:` that guards it
            covered = covered or opener.startswith("#") or re.match(r"try\s*:\s*#", opener) is not None
            if not covered:
                where = f"{fn.name}()"
                out.append(f"line {node.lineno}: `{lines[node.lineno - 1].strip()}` inside {where} without a comment saying why")
    return out


def _dotted(node) -> str:
    """`a.b.c` for a Name/Attribute chain, else ""."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def _calls(node, *names: str) -> bool:
    """Whether `node` calls a function whose dotted name is, or ends with `.` and, one of `names`."""
    if not isinstance(node, ast.Call):
        return False
    name = _dotted(node.func)
    return any(name == n or name.endswith("." + n) for n in names)


def _reads_keras_backend_env(node) -> bool:
    """`os.environ.get("KERAS_BACKEND")`, `os.getenv(...)`, `os.environ["KERAS_BACKEND"]`, `"KERAS_BACKEND" in os.environ`."""
    def is_name(n):
        return isinstance(n, ast.Constant) and n.value == "KERAS_BACKEND"

    def is_environ(n):
        return _dotted(n) in ("os.environ", "environ")

    if isinstance(node, ast.Call):
        return _calls(node, "environ.get", "getenv") and bool(node.args) and is_name(node.args[0])
    if isinstance(node, ast.Subscript):
        return isinstance(node.ctx, ast.Load) and is_environ(node.value) and is_name(node.slice)
    return (isinstance(node, ast.Compare) and is_name(node.left)
            and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) and any(map(is_environ, node.comparators)))


def _backend_branches(tree) -> list[str]:
    """The backend-branch breaches of one module (the module docstring says what counts)."""
    out = []
    conditions = []  # expressions whose value decides what runs
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "jax" for a in node.names):
            out.append(f"line {node.lineno}: imports jax")
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "jax":
            out.append(f"line {node.lineno}: imports from {node.module}")
        elif _calls(node, "backend.backend", "config.backend"):
            out.append(f"line {node.lineno}: asks Keras for its backend ({_dotted(node.func)}())")
        elif _calls(node, "is_jax"):
            out.append(f"line {node.lineno}: is_jax()")
        elif _reads_keras_backend_env(node):
            out.append(f"line {node.lineno}: reads KERAS_BACKEND from os.environ")
        if isinstance(node, (ast.If, ast.While, ast.IfExp, ast.Assert)):
            conditions.append(node.test)
        elif isinstance(node, ast.comprehension):
            conditions.extend(node.ifs)
        elif isinstance(node, ast.Compare):
            conditions.append(node)
    lines = sorted({n.lineno for c in conditions for n in ast.walk(c) if _calls(n, "backend_name")})
    return out + [f"line {n}: backend_name() decides what runs" for n in lines]


def _private_attributes(tree, private_names) -> list[str]:
    """`obj._name` and `getattr(obj, "_name")` (also `setattr`, `hasattr`) on anything but `self`, `cls`, `super()`."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            owner, name = node.value, node.attr
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            owner, name = node.args[0], node.args[1].value
        else:
            continue
        if name == "__internal__":
            out.append(f"line {node.lineno}: .__internal__ (a private namespace)")
            continue
        if not name.startswith("_") or name.startswith("__") or name not in private_names:
            continue
        if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
            continue
        if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
            continue
        out.append(f"line {node.lineno}: .{name} (a private name of Keras/KerasTuner/tf.distribute)")
    return out


def _private_methods_of_bases(tree, private_methods) -> list[str]:
    """In a class with bases: `def _x(self, ...)` or `self._x(...)`/`super()._x(...)` for an upstream private method."""
    out = []
    for cls in ast.walk(tree):
        if not isinstance(cls, ast.ClassDef) or not cls.bases:
            continue
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in private_methods:
                out.append(f"line {node.lineno}: {cls.name} overrides .{node.name} (a private method of Keras/KerasTuner/tf.distribute)")
        for node in ast.walk(cls):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in private_methods):
                continue
            owner = node.func.value
            if (isinstance(owner, ast.Name) and owner.id == "self") or (
                    isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super"):
                out.append(f"line {node.lineno}: {cls.name} calls .{node.func.attr} (a private method of Keras/KerasTuner/tf.distribute)")
    return out


def _cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each as a sorted list."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


# --------------------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def found():
    return violations()


def test_the_package_keeps_the_import_contract(found):
    new = [v for v in found if (v[0], v[1]) not in KNOWN]
    assert not new, "Import contract broken (docs/architecture.md):\n" + "\n".join(f"  {r} {f}: {w}" for r, f, w in new)


@pytest.mark.parametrize("rule,path", sorted(KNOWN))
@pytest.mark.xfail(strict=True, reason="a violation accepted for now (KNOWN): once fixed, delete its entry")
def test_known_violation_is_gone(found, rule, path):
    assert not [w for r, f, w in found if (r, f) == (rule, path)]


# --------------------------------------------------------------------------- the checker fails on each kind
def _plant(tmp_path, files: dict) -> Path:
    for name, text in files.items():
        p = tmp_path / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    return tmp_path


_MINI = {"trainwell": "trainwell", "callbacks": "trainwell.callbacks", "recipes": "trainwell.recipes"}
_CLEAN = {
    "trainwell/__init__.py": "from trainwell import io  # noqa\n",
    "trainwell/io.py": "import os\n",
    "trainwell/config.py": "from trainwell import io\n\n\ndef f():\n    import json  # lazy: why\n",
    "callbacks/__init__.py": "",
    "callbacks/cb.py": "from trainwell.config import f\n\n\nclass C:\n    def g(self):\n        return self._learning_rate\n",
    "recipes/__init__.py": "",
    "recipes/r.py": "from trainwell.callbacks.cb import C\n",
    "recipes/other.py": "import os\n",
    "trainwell/cli.py": "from trainwell.recipes import r\n",
    # not backend branches: the workers' environment read and this one's set, the backend's name
    # recorded, a docstring and a comment
    "trainwell/launch.py": "import os\n\n\ndef envs(base_env):\n    '''KERAS_BACKEND=jax: keras.config.backend() == 'jax'.'''\n"
                           "    os.environ['KERAS_BACKEND'] = 'jax'\n"
                           "    return base_env.get('KERAS_BACKEND') == 'jax'\n",
    "trainwell/rundir.py": "from trainwell.compat import backend_name\n\n\ndef manifest():\n"
                           "    return {'backend': backend_name()}  # if backend_name() == 'jax': import jax\n",
    "trainwell/compat/__init__.py": "from keras.src import ops\n\n\ndef lr(o):\n    return o._learning_rate\n\n\n"
                                    "class NoDecay(Base):\n    def _apply_weight_decay(self, v):\n        return self._lr(v)\n",
    # the seam may branch on the backend
    "trainwell/compat/backend.py": "import os\n\nimport jax\nimport keras\n\n\ndef is_jax():\n"
                                   "    return keras.config.backend() == 'jax' or os.environ.get('KERAS_BACKEND') == 'jax'\n",
}


@pytest.mark.parametrize("planted,rule", [
    ({"callbacks/cb.py": "def f():\n    from trainwell.recipes import other  # lazy\n"}, "back-edge"),
    ({"trainwell/config.py": "from trainwell.launch import main\n"}, "back-edge"),
    ({"recipes/r.py": "from trainwell import lr_find\n"}, "facade"),
    ({"trainwell/io.py": "from trainwell import config\n"}, "cycle"),
    ({"recipes/r.py": "from keras.src.trainers import trainer\n"}, "private"),
    ({"recipes/r.py": "def f(opt):\n    return opt._learning_rate\n"}, "private"),
    ({"recipes/r.py": "import tensorflow as tf\n\n\ndef f():\n    return tf.__internal__.distribute\n"}, "private"),
    ({"recipes/r.py": "class O(Base):\n    def _apply_weight_decay(self, v):\n        return None\n"}, "private"),
    ({"recipes/r.py": "class O(Base):\n    def f(self):\n        return super()._lr(self._lr(1))\n"}, "private"),
    ({"recipes/r.py": "def f():\n    import keras\n    return keras\n"}, "local-import"),
    ({"trainwell/newthing.py": "x = 1\n"}, "floor"),
    ({"recipes/r.py": "import keras\n\n\ndef f():\n    return 1 if keras.backend.backend() == 'jax' else 2\n"},
     "backend-branch"),
    ({"trainwell/io.py": "import keras\n\n\ndef f():\n    name = keras.config.backend()\n    return name\n"},
     "backend-branch"),
    ({"callbacks/cb.py": "from trainwell.compat.backend import is_jax\n\nJAX = is_jax()\n"}, "backend-branch"),
    ({"callbacks/cb.py": "from trainwell.compat import backend_name\n\n\ndef f():\n"
                         "    if backend_name() != 'tensorflow':\n        return 1\n"}, "backend-branch"),
    ({"callbacks/cb.py": "from trainwell import compat\n\nTF = compat.backend_name() == 'tensorflow'\n"},
     "backend-branch"),
    ({"recipes/r.py": "import os\n\nJAX = os.environ.get('KERAS_BACKEND') == 'jax'\n"}, "backend-branch"),
    ({"recipes/r.py": "import os\n\nJAX = os.getenv('KERAS_BACKEND', '') == 'jax'\n"}, "backend-branch"),
    ({"recipes/r.py": "import os\n\nJAX = os.environ['KERAS_BACKEND'] == 'jax'\n"}, "backend-branch"),
    ({"recipes/r.py": "import os\n\nSET = 'KERAS_BACKEND' in os.environ\n"}, "backend-branch"),
    ({"recipes/r.py": "def f():\n    import jax  # lazy: only on JAX\n    return jax.devices()\n"}, "backend-branch"),
    ({"trainwell/io.py": "from jax import numpy as jnp\n"}, "backend-branch"),
])
def test_the_checker_finds_each_kind_of_breach(tmp_path, planted, rule):
    floors = dict(FLOORS)
    private, methods = frozenset({"_learning_rate"}), frozenset({"_apply_weight_decay", "_lr"})
    assert violations(_plant(tmp_path / "clean", _CLEAN), _MINI, floors, private, methods) == []
    got = violations(_plant(tmp_path / "planted", {**_CLEAN, **planted}), _MINI, floors, private, methods)
    assert {r for r, _, _ in got} == {rule}, got
