"""Text classification data: sources, label mapping, and tokenising `tf.data` pipelines.

The sources and the label mapping are here; the pipelines of step 2 are in
`trainwell.data.text_pipelines` and importable from here.

Two steps, kept apart so each can be tested and reused:

1. `load_text_splits(source, ...)` reads a source into memory as train / validation /
   test arrays of strings and int64 label ids (`TextSplits`), with one label mapping:

   - `"rotten_tomatoes"`: the embedded review snippets (`trainwell.data.embedded`);
   - `"tfds:NAME"` (`tfds:glue/sst2`, `tfds:imdb_reviews`, ...): a prepared TFDS text
     dataset (never downloaded here); splits without labels (GLUE's test split, label
     -1) are ignored, and the validation split serves as the test split when there is
     no labelled test split;
   - `"csv:PATH"` / `"jsonl:PATH"`: a file (train only: validation and test are carved
     from it) or a directory with `train.csv` and optionally `val.csv` (or
     `validation.csv`, `dev.csv`) and `test.csv` (`.jsonl` likewise);
   - plain Python: `(texts, labels)` or `{"train": (texts, labels), "val": ..., "test": ...}`.

   `text_field` and `label_field` name the columns (keys); the text field defaults to
   the first of `text`, `sentence`, `review`, `content` that exists. The distinct
   training labels are sorted (numerically when all are integers, else as strings) and
   numbered 0..K-1 (labels {0, 7} are 2 classes named "0" and "7"), and that mapping
   (`class_names`) is what `save_label_map` writes next to the exported model. A label
   that is not one value (a JSON list), a label in validation/test data that training
   never saw, a single class, a missing column, an empty file, a file that is not
   UTF-8: a one-line `trainwell.data.sources.DataError` naming the field, file and line.
   Validation (and test, when missing) are carved from train with
   `trainwell.data.embedded.stratified_split`: deterministic and stratified.

2. `build_text_datasets(splits, preprocessor, global_batch_size, ...)` turns the
   arrays into batched `(inputs, labels)` datasets, tokenising **inside the tf.data
   pipeline**: the keras-hub preprocessor (e.g. `BertTextClassifierPreprocessor`) is
   mapped over the strings, once, and the token ids are cached in memory. Training
   batches are grouped by length (`Dataset.group_by_window`, the `tf.data` form of
   `bucket_by_sequence_length`; Hugging Face's `group_by_length`) and cut to their
   bucket's boundary, so a batch of short review snippets is not padded to
   `sequence_length`: the transformer's cost falls with the padded length. Evaluation
   batches keep their order and are cut to the longest example in the batch rounded up
   to a multiple of 16.

Exact resume: the training set is shuffled with a fixed seed and
`reshuffle_each_iteration=True`, and its cardinality is asserted (the exact number of
full batches: per bucket `floor(n_bucket / batch)`, the same every epoch), so Keras
makes a new iterator each epoch and `trainwell.recipes.harness.advance_epochs` can position a
restarted run at its epoch, as for the image pipelines.

Example:
>>> splits = load_text_splits((["good", "bad"] * 20, ["pos", "neg"] * 20), val_fraction=0.2, test_fraction=0.2)
>>> splits.class_names, splits.sizes()
(['neg', 'pos'], {'train': 24, 'val': 8, 'test': 8})
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from trainwell.data.base import DataError, DataNotFoundError, json_lines, open_tfds_builder, resolve_path
from trainwell.data.embedded import load_rotten_tomatoes, stratified_split
from trainwell.data.text_pipelines import (  # noqa: F401 - documented here: trainwell.data.text.build_text_datasets
    TextDatasets,
    bucket_boundaries,
    build_text_datasets,
    make_eval_dataset,
)
from trainwell.io import atomic_write_json
from trainwell.validation import invalid_argument

TEXT_FIELD_CANDIDATES = ("text", "sentence", "review", "content")
LABEL_MAP_FILE = "labels.json"
_VAL_NAMES = ("val", "validation", "dev")
# Splits of TFDS text datasets, for when the builder's info does not list them
# (e.g. under `tfds.testing.mock_data`). GLUE's test labels are hidden (-1).
_TFDS_KNOWN_SPLITS = {"glue": ("train", "validation"), "imdb_reviews": ("train", "test")}


# --------------------------------------------------------------------------- splits
@dataclasses.dataclass
class TextSplits:
    """Train / validation / test texts and label ids of one source, in memory.

    Attributes:
        name: The source (`"rotten_tomatoes"`, `"csv:reviews.csv"`, `"memory"`, ...).
        train, val, test: `(texts, labels)`: an object array of `str` and int64 ids;
            `val`/`test` may be `None` (when `val_fraction` / `test_fraction` is 0 and
            the source has none).
        class_names: Label names, indexed by id.

    Example:
    >>> s = load_text_splits((["a", "b"] * 10, [0, 1] * 10), val_fraction=0.1, test_fraction=0.0)
    >>> s.num_classes, s.test is None
    (2, True)
    """

    name: str
    train: tuple[np.ndarray, np.ndarray]
    val: tuple[np.ndarray, np.ndarray] | None
    test: tuple[np.ndarray, np.ndarray] | None
    class_names: list[str]

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def label_to_id(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.class_names)}

    def sizes(self) -> dict[str, int]:
        return {k: (0 if getattr(self, k) is None else len(getattr(self, k)[1])) for k in ("train", "val", "test")}


def _as_texts(values: Iterable[Any], where: str) -> np.ndarray:
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bytes):
            v = v.decode("utf-8", errors="replace")
        if v is None or not isinstance(v, str):
            raise DataError(f"Text #{i} of {where} is not a string. Received: {_short(v)}")
        out.append(v)
    return np.array(out, dtype=object)


def _short(v: Any, n: int = 80) -> str:
    r = repr(v)
    return r if len(r) <= n else r[: n - 3] + "..."


def _is_int_label(v: Any) -> bool:
    if isinstance(v, bool):
        return False
    if isinstance(v, (int, np.integer)):
        return True
    if isinstance(v, (float, np.floating)):
        return float(v).is_integer()
    if isinstance(v, str):
        s = v.strip()
        return bool(s) and (s.isdigit() or (s[0] == "-" and s[1:].isdigit()))
    return False


def _is_scalar_label(v: Any) -> bool:
    if isinstance(v, np.ndarray):
        return v.ndim == 0
    return isinstance(v, (str, bytes, int, float, np.generic))


def _encode_labels(
    raw: dict[str, list], class_names: Sequence[str] | None, where: dict[str, str]
) -> tuple[dict[str, np.ndarray], list[str]]:
    """Maps raw labels of each split to ids; the training labels define the mapping.

    Without `class_names`, the distinct training labels are sorted (numerically when
    they are all integers, else as strings) and numbered 0..K-1: labels {0, 7} are two
    classes named "0" and "7", not eight. A label must be one value (a string or a
    number, not a list), and the training data must hold at least two classes.
    """
    for split, labels in raw.items():
        for i, v in enumerate(labels):
            if v is None or (isinstance(v, str) and not v.strip()):
                raise DataError(f"Empty label in row {i + 1} of {where[split]}.")
            if not _is_scalar_label(v):
                raise DataError(
                    f"The label in row {i + 1} of {where[split]} is not a single value: {_short(v)}. "
                    "Expected one string or number per example."
                )
    train = raw["train"]
    int_index: dict[int, int] | None = None
    if class_names is not None:
        names = [str(c) for c in class_names]
        index = {n: i for i, n in enumerate(names)}
        as_ids = all(_is_int_label(v) for vs in raw.values() for v in vs) and not all(
            str(v).strip() in index for vs in raw.values() for v in vs
        )
    else:
        as_ids = False
        if all(_is_int_label(v) for vs in raw.values() for v in vs):
            distinct = sorted({int(float(v)) for v in train})
            names = [str(d) for d in distinct]
            int_index = {d: i for i, d in enumerate(distinct)}
        else:
            names = sorted({str(v).strip() for v in train})
        index = {n: i for i, n in enumerate(names)}
    out: dict[str, np.ndarray] = {}
    for split in ("train", *[s for s in raw if s != "train"]):
        ids = []
        for v in raw[split]:
            if as_ids:  # integer labels with given class names: the labels are the ids
                k = int(float(v))
                if not 0 <= k < len(names):
                    raise DataError(
                        f"Label {k} in {where[split]} is out of range: expected a class id in [0, {len(names)})."
                    )
            elif int_index is not None:
                k = int_index.get(int(float(v)), -1)
                if k < 0:
                    raise DataError(
                        f"Label {int(float(v))} in {where[split]} never occurs in the training data "
                        f"({where['train']}); known labels: {_short(names, 200)}."
                    )
            else:
                key = str(v).strip()
                if key not in index:
                    if class_names is None:
                        raise DataError(
                            f"Label {key!r} in {where[split]} never occurs in the training data "
                            f"({where['train']}); known labels: {_short(names, 200)}."
                        )
                    raise DataError(f"Label {key!r} in {where[split]} is not one of class_names={names}.")
                k = index[key]
            ids.append(k)
        out[split] = np.array(ids, dtype=np.int64)
    seen = np.unique(out["train"])
    if len(seen) < 2:
        only = names[int(seen[0])] if len(seen) else None
        raise DataError(
            f"The training data ({where['train']}) has only one class ({only!r}, {len(out['train'])} examples): "
            "a classifier needs at least 2."
        )
    return out, names


def _pick_text_field(fields: Sequence[str], text_field: str | None, where: str) -> str:
    if text_field is not None:
        if text_field not in fields:
            raise DataError(
                f"Text field {text_field!r} not found in {where}; fields: {list(fields)}. Set `text_field`."
            )
        return text_field
    for c in TEXT_FIELD_CANDIDATES:
        if c in fields:
            return c
    raise DataError(
        f"No text field in {where}: none of {list(TEXT_FIELD_CANDIDATES)} among its fields {list(fields)}. "
        "Set `text_field`."
    )


#: Longest CSV field read: Python's `csv` stops at 128 KiB, shorter than some documents.
CSV_FIELD_LIMIT = 1 << 30


def _not_utf8(path: Path) -> DataError:
    """The one-line error for a file that is not UTF-8, naming the line and the byte."""
    raw = path.read_bytes()
    try:
        raw.decode("utf-8")
        start = 0
    except UnicodeDecodeError as e:
        start = e.start
    line = raw.count(b"\n", 0, start) + 1
    byte = f"byte 0x{raw[start]:02x} " if start < len(raw) else ""
    return DataError(f"{str(path)!r} is not UTF-8 text ({byte}on line {line}); save it as UTF-8.")


def _read_csv(path: Path) -> tuple[list[str], list[dict]]:
    old_limit = csv.field_size_limit(CSV_FIELD_LIMIT)
    try:
        with path.open(newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f)
            try:
                fields = [c for c in (reader.fieldnames or [])]
                rows = [r for r in reader if any((v or "").strip() for v in r.values() if isinstance(v, str))]
            except csv.Error as e:
                raise DataError(f"Cannot read {str(path)!r} as CSV (line {reader.line_num}): {e}.") from None
    except UnicodeDecodeError:
        raise _not_utf8(path) from None
    finally:
        csv.field_size_limit(old_limit)
    return fields, rows


def _read_jsonl(path: Path) -> tuple[list[str], list[dict]]:
    rows: list[dict] = []
    fields: list[str] = []
    try:
        for n, row, line in json_lines(path, lambda n, why, _: f"Invalid JSON on line {n} of {str(path)!r}: {why}."):
            if not isinstance(row, dict):
                raise DataError(f"Line {n} of {str(path)!r} is not a JSON object. Received: {_short(line)}")
            for k in row:
                if k not in fields:
                    fields.append(k)
            rows.append(row)
    except UnicodeDecodeError:
        raise _not_utf8(path) from None
    return fields, rows


def _read_table(path: Path, kind: str, text_field: str | None, label_field: str) -> tuple[list, list]:
    if not path.is_file():
        raise DataNotFoundError(f"Data file not found: {str(path)!r}")
    if path.stat().st_size == 0:
        raise DataError(f"Empty file: {str(path)!r} has no rows.")
    fields, rows = _read_csv(path) if kind == "csv" else _read_jsonl(path)
    if not rows:
        raise DataError(f"Empty file: {str(path)!r} has no rows.")
    where = repr(str(path))
    tf_name = _pick_text_field(fields, text_field, where)
    if label_field not in fields:
        raise DataError(f"Label field {label_field!r} not found in {where}; fields: {fields}. Set `label_field`.")
    texts, labels = [], []
    for i, r in enumerate(rows):
        if r.get(tf_name) is None:
            raise DataError(f"Row {i + 1} of {where} has no value for the text field {tf_name!r}.")
        if r.get(label_field) is None:
            raise DataError(f"Row {i + 1} of {where} has no value for the label field {label_field!r}.")
        texts.append(r[tf_name])
        labels.append(r[label_field])
    return texts, labels


def _source_files(kind: str, rest: str, data_dir: str | None) -> dict[str, Path]:
    path = Path(resolve_path(rest, data_dir))
    if not path.is_dir():
        return {"train": path}
    ext = f".{kind}"
    files = {"train": path / f"train{ext}"}
    if not files["train"].is_file():
        raise DataNotFoundError(f"No training file in {str(path)!r}: expected {files['train'].name}.")
    for name in _VAL_NAMES:
        if (path / f"{name}{ext}").is_file():
            files["val"] = path / f"{name}{ext}"
            break
    if (path / f"test{ext}").is_file():
        files["test"] = path / f"test{ext}"
    return files


# The last CSV/JSONL sources read, by file identity: building a config checks the file
# (`trainwell.data.sources.check_text_source`), and the run that follows reuses the parse.
_FILE_CACHE: dict[tuple, tuple[dict, dict]] = {}
_FILE_CACHE_SIZE = 2


def read_file_source(
    kind: str,
    rest: str,
    data_dir: str | None = None,
    text_field: str | None = None,
    label_field: str = "label",
    check_labels: bool = False,
) -> tuple[dict[str, tuple[list, list]], dict[str, str]]:
    """Reads a `csv:`/`jsonl:` source into `({split: (texts, labels)}, {split: "'file'"})`.

    A file is train only; a directory holds `train.EXT` and optionally
    `val`/`validation`/`dev.EXT` and `test.EXT`. The parse of the last sources read is
    cached by file path, size and modification time, so checking a config and then
    training reads each file once.

    Args:
        kind: `"csv"` or `"jsonl"`.
        rest: The path after `kind:`.
        data_dir: Base of a relative path. Defaults to `None`.
        text_field: The text column. Defaults to `None` (the first of the usual names).
        label_field: The label column. Defaults to `"label"`.
        check_labels: Also check the texts and labels (strings; one value per label; at
            least two classes; no validation/test label unseen in training).
            Defaults to `False`.

    Raises:
        DataError: a missing file (`DataNotFoundError`), a file that is not UTF-8 or not
            CSV/JSONL, an empty file, a missing field or value, bad labels. One line
            naming the file (and the line or row).

    Example:
    >>> raw, where = read_file_source("csv", "reviews.csv")  # doctest: +SKIP
    """
    files = _source_files(kind, rest, data_dir)
    stats = []
    for split, p in files.items():
        try:
            st = p.stat()
        except OSError:
            raise DataNotFoundError(f"Data file not found: {str(p)!r}") from None
        stats.append((split, str(p), st.st_size, st.st_mtime_ns))
    key = (kind, text_field, label_field, tuple(stats))
    hit = _FILE_CACHE.get(key)
    if hit is None:
        raw = {split: _read_table(p, kind, text_field, label_field) for split, p in files.items()}
        hit = (raw, {split: repr(str(p)) for split, p in files.items()})
        while len(_FILE_CACHE) >= _FILE_CACHE_SIZE:
            _FILE_CACHE.pop(next(iter(_FILE_CACHE)))
        _FILE_CACHE[key] = hit
    raw, where = dict(hit[0]), dict(hit[1])
    if check_labels:
        for split, (texts, _) in raw.items():
            _as_texts(texts, where[split])
        _encode_labels({k: v[1] for k, v in raw.items()}, None, where)
    return raw, where


def _tfds_source(name: str, data_dir: str | None, text_field, label_field) -> tuple[dict, dict, list[str] | None]:
    # lazy: TFDS loads on first use, not with this module
    import tensorflow_datasets as tfds

    builder = open_tfds_builder(name, data_dir)
    info = builder.info
    features = dict(info.features.items())
    text_keys = [k for k, f in features.items() if isinstance(f, tfds.features.Text)]
    tf_name = _pick_text_field(text_keys or list(features), text_field, f"TFDS dataset {name!r}")
    if label_field not in features:
        raise DataError(
            f"Label field {label_field!r} not found in TFDS dataset {name!r}; fields: {list(features)}. "
            "Set `label_field`."
        )
    label_feature = features[label_field]
    names = list(label_feature.names) if isinstance(label_feature, tfds.features.ClassLabel) else None
    known = dict(info.splits.items()) if info.splits else {}
    available = list(known) if known else list(_TFDS_KNOWN_SPLITS.get(name.split("/")[0].split(":")[0], ("train", "test")))
    if "train" not in available:
        raise DataError(f"TFDS dataset {name!r} has no 'train' split. Splits: {sorted(available)}.")
    raw, where = {}, {}
    for tfds_split, split in (("train", "train"), ("validation", "val"), ("test", "test")):
        if tfds_split not in available:
            continue
        try:
            ds = builder.as_dataset(split=tfds_split, shuffle_files=False)
        except (AssertionError, FileNotFoundError) as e:
            raise DataNotFoundError(
                f"TFDS dataset {name!r} is not prepared in data_dir {str(builder.data_dir)!r}: "
                f"{str(e).strip().rstrip('.')}. Prepare it first (e.g. `tfds build {name} --data_dir DIR`)."
            ) from None
        texts, labels = [], []
        for ex in tfds.as_numpy(ds):
            texts.append(ex[tf_name])
            labels.append(int(ex[label_field]))
        if not labels or all(v < 0 for v in labels):  # unlabelled (GLUE test: -1)
            continue
        raw[split] = (texts, labels)
        where[split] = f"the {tfds_split!r} split of TFDS dataset {name!r}"
    if "train" not in raw:
        raise DataError(f"The 'train' split of TFDS dataset {name!r} is empty.")
    if "test" not in raw and "val" in raw:  # GLUE: validation is the held-out test
        raw["test"], where["test"] = raw.pop("val"), where.pop("val")
    return raw, where, names


def _memory_source(source: Any) -> tuple[dict, dict]:
    if isinstance(source, dict):
        parts = {}
        for k, v in source.items():
            key = "val" if k in _VAL_NAMES else k
            if key not in ("train", "val", "test"):
                raise ValueError(f"Unknown split {k!r} in the data dict: expected 'train', 'val' or 'test'.")
            parts[key] = v
        if "train" not in parts:
            raise ValueError("The data dict has no 'train' split.")
    else:
        parts = {"train": source}
    raw, where = {}, {}
    for split, pair in parts.items():
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise ValueError(f"The {split!r} data must be a pair (texts, labels). Received: {type(pair).__name__}")
        texts, labels = list(pair[0]), list(pair[1])
        if len(texts) != len(labels):
            raise ValueError(
                f"The {split!r} data has {len(texts)} texts but {len(labels)} labels: they must match one to one."
            )
        raw[split] = (texts, labels)
        where[split] = f"the {split!r} data"
    return raw, where


def load_text_splits(
    source: Any,
    *,
    text_field: str | None = None,
    label_field: str = "label",
    val_fraction: float = 0.1,
    test_fraction: float = 0.2,
    seed: int = 0,
    data_dir: str | None = None,
    class_names: Sequence[str] | None = None,
    max_train_examples: int | None = None,
) -> TextSplits:
    """Reads a text classification source into train / validation / test arrays.

    Args:
        source: `"rotten_tomatoes"`, `"tfds:NAME"`, `"csv:PATH"`, `"jsonl:PATH"`,
            `(texts, labels)` or `{"train": (texts, labels), "val": ..., "test": ...}`
            (see the module docstring).
        text_field: Column/key of the text. Defaults to `None` (the first of `text`,
            `sentence`, `review`, `content` present).
        label_field: Column/key of the label. Defaults to `"label"`.
        val_fraction: Fraction of train carved out as validation when the source has no
            validation split; `0` for none. Defaults to `0.1`.
        test_fraction: Fraction of train carved out as test when the source has no
            (labelled) test split; `0` for none. Defaults to `0.2`.
        seed: Seed of the carved splits. Defaults to `0`.
        data_dir: TFDS data directory, and base of relative file paths. Defaults to `None`.
        class_names: Fixed label names (their order gives the ids) instead of the mapping
            inferred from the training labels. Defaults to `None`.
        max_train_examples: Keep only the first N training examples (after the split),
            for quick runs. Defaults to `None` (all).

    Returns:
        A `TextSplits`.

    Raises:
        DataNotFoundError: a file, directory or TFDS dataset that is missing or not
            prepared (also a `FileNotFoundError`).
        DataError: a missing text/label field, an empty file, a file that is not UTF-8,
            a label that is not one value, a label unseen in training, a single class;
            the message names the field or file.
        ValueError: a bad argument.

    Example:
    >>> s = load_text_splits("rotten_tomatoes")
    >>> s.class_names, s.sizes()["test"]
    (['rotten', 'fresh'], 2562)
    """
    _check_split_arguments(val_fraction, test_fraction, max_train_examples, label_field)
    names_from_source = None
    if isinstance(source, str):
        name = source.strip()
        kind, _, rest = name.partition(":")
        kind = kind.lower()
        if name == "rotten_tomatoes":
            s = load_rotten_tomatoes(val_fraction=val_fraction, test_fraction=test_fraction, seed=seed)
            out = TextSplits(
                name=name, train=s.train, val=s.val if val_fraction > 0 else None,
                test=s.test if test_fraction > 0 else None, class_names=list(s.class_names),
            )
            return _truncate(out, max_train_examples)
        if kind in ("csv", "jsonl") and rest:
            raw, where = read_file_source(kind, rest, data_dir, text_field, label_field)
        elif kind == "tfds" and rest:
            raw, where, names_from_source = _tfds_source(rest, data_dir, text_field, label_field)
        else:
            raise invalid_argument("source", "'rotten_tomatoes', 'tfds:NAME', 'csv:PATH', 'jsonl:PATH', "
                  "(texts, labels) or {'train': (texts, labels), ...}", source)
    else:
        name = "memory"
        raw, where = _memory_source(source)

    texts = {k: _as_texts(v[0], where[k]) for k, v in raw.items()}
    _check_not_empty(texts, where)
    names_arg = class_names if class_names is not None else names_from_source
    labels, names = _encode_labels({k: v[1] for k, v in raw.items()}, names_arg, where)

    train, val, test = _carve(texts, labels, val_fraction, test_fraction, seed, where)
    out = TextSplits(name=name, train=train, val=val, test=test, class_names=list(names))
    return _truncate(out, max_train_examples)


def _check_not_empty(texts: dict, where: dict) -> None:
    for k, t in texts.items():
        if len(t) == 0:
            raise DataError(f"No examples in {where[k]}.")


def _check_split_arguments(val_fraction, test_fraction, max_train_examples, label_field) -> None:
    """Raises `invalid_argument`'s error for a bad argument of `load_text_splits`."""
    for arg, v in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1:
            raise invalid_argument(arg, "a float in [0, 1)", v)
    if val_fraction + test_fraction >= 1:
        raise invalid_argument("test_fraction", f"val_fraction + test_fraction < 1 (val_fraction={val_fraction})", test_fraction)
    if max_train_examples is not None and (isinstance(max_train_examples, bool) or not isinstance(max_train_examples, int) or max_train_examples < 1):
        raise invalid_argument("max_train_examples", "None or an int >= 1", max_train_examples)
    if not isinstance(label_field, str) or not label_field:
        raise invalid_argument("label_field", "a non-empty string", label_field)


def _carve(texts: dict, labels: dict, val_fraction: float, test_fraction: float, seed: int, where: dict):
    """`(train, val, test)` pairs: the source's own splits, and what it lacks carved from train
    (stratified, deterministic); `None` for a split neither given nor carved."""
    has_val, has_test = "val" in texts, "test" in texts
    carve_val = 0.0 if has_val else val_fraction
    carve_test = 0.0 if has_test else test_fraction
    x, y = texts["train"], labels["train"]
    if carve_val or carve_test:
        idx = stratified_split(y, carve_val, carve_test, seed)
        parts = {k: (x[i], y[i]) for k, i in idx.items()}
    else:
        parts = {"train": (x, y)}
    train = parts["train"]
    if len(train[1]) == 0:
        raise DataError(f"No training examples left in {where['train']} after carving validation/test.")
    val = (texts["val"], labels["val"]) if has_val else (parts["val"] if carve_val else None)
    test = (texts["test"], labels["test"]) if has_test else (parts["test"] if carve_test else None)
    return train, val, test


def _truncate(s: TextSplits, n: int | None) -> TextSplits:
    if n is None or n >= len(s.train[1]):
        return s
    return dataclasses.replace(s, train=(s.train[0][:n], s.train[1][:n]))


# --------------------------------------------------------------------------- label map
def save_label_map(path: str | os.PathLike, class_names: Sequence[str]) -> Path:
    """Writes the label mapping (`labels.json`) atomically.

    Args:
        path: A directory (the file is `path/labels.json`) or a `.json` file path.
        class_names: Label names, indexed by id.

    Returns:
        The file written.

    Example:
    >>> import tempfile
    >>> load_label_map(save_label_map(tempfile.mkdtemp(), ["neg", "pos"]))
    ['neg', 'pos']
    """

    p = Path(path)
    if p.suffix != ".json":
        p = p / LABEL_MAP_FILE
    names = [str(c) for c in class_names]
    return atomic_write_json(p, {"class_names": names, "label_to_id": {n: i for i, n in enumerate(names)}})


def load_label_map(path: str | os.PathLike) -> list[str]:
    """Reads `labels.json` (a directory holding it, or the file) and returns the class names.

    Example:
    >>> load_label_map("runs/x/model")  # doctest: +SKIP
    ['rotten', 'fresh']
    """
    p = Path(path)
    if p.is_dir() or p.suffix != ".json":
        p = p / LABEL_MAP_FILE
    if not p.is_file():
        raise FileNotFoundError(f"Label map not found: {str(p)!r}")
    data = json.loads(p.read_text(encoding="utf-8"))
    names = data.get("class_names") if isinstance(data, dict) else None
    if not isinstance(names, list) or not names:
        raise ValueError(f"Invalid label map {str(p)!r}: expected a non-empty `class_names` list.")
    return [str(n) for n in names]
