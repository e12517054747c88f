"""Serving the transformer recipe's model: the export (a keras-hub preset + `labels.json`) and `predict`.

Kept apart from the training recipe (`trainwell.recipes.transformer_finetune`, which
re-exports these names): a service that only classifies texts needs this module and
the export, not the training code. keras-hub already saves and reloads a task with its
preprocessor (`save_to_preset` / `TextClassifier.from_preset`); what this adds is an
atomic export, the label names next to it, and probabilities for a list of strings.

Example:
>>> from trainwell.recipes.transformer_serving import predict
>>> labels, probs = predict(["A triumph."], run_dir="runs/x")  # doctest: +SKIP
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Sequence

import numpy as np

from trainwell.data.text import load_label_map, make_eval_dataset, save_label_map
from trainwell.io import fsync_dir
from trainwell.validation import invalid_argument

#: The export's directory inside a run directory.
EXPORT_DIR = "model"


def export_model(model, preprocessor, class_names: Sequence[str], path) -> Path:
    """Saves `model` with its preprocessor as a keras-hub preset, plus `labels.json`.

    Written to a temporary directory next to `path` and renamed into place, so a
    reader never sees a half-written export. Reload with
    `keras_hub.models.TextClassifier.from_preset(path)` or use `predict`.

    Example:
    >>> export_model(run.model, build_preprocessor(cfg), ["neg", "pos"], run.run_dir / "model")  # doctest: +SKIP
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{path.name}-", dir=path.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the export is a normal directory
    old = None
    try:
        # A clean copy: the compiled model would also save its optimizer state (twice
        # the model's size for Adam) into the preset's task weights.
        clean = type(model).from_config(model.get_config())
        clean.set_weights(model.get_weights())
        clean.preprocessor = preprocessor
        clean.save_to_preset(str(tmp))
        save_label_map(tmp, class_names)
        if path.exists():
            old = path.parent / f".old-{path.name}-{os.getpid()}"
            os.replace(path, old)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and old.exists() and not path.exists():
            os.replace(old, path)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return path


def load_exported(run_dir):
    """`(model, class_names)` of the model exported in `run_dir` (or its `model/` dir).

    Example:
    >>> model, names = load_exported("runs/transformer-finetune-20250101-000000")  # doctest: +SKIP
    """
    import keras_hub  # lazy: keras-hub (and TensorFlow) load when a model is served, not with the recipe

    path = Path(run_dir)
    if (path / EXPORT_DIR).is_dir():
        path = path / EXPORT_DIR
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"No exported model in {str(run_dir)!r} (expected {EXPORT_DIR}/config.json).")
    return keras_hub.models.TextClassifier.from_preset(str(path)), load_label_map(path)


def predict(texts: Sequence[str], run_dir=None, *, model=None, class_names=None, batch_size: int = 64):
    """Predicted labels and class probabilities for `texts`.

    Args:
        texts: Strings to classify.
        run_dir: A run directory (or its `model/` directory) holding an export.
            Defaults to `None` (then `model` is required).
        model: A `TextClassifier` with its preprocessor attached (e.g. `run.model`),
            used instead of loading `run_dir`. Defaults to `None`.
        class_names: Label names by id; read from the export's `labels.json` when
            `None`. Defaults to `None`.
        batch_size: Batch size. Defaults to `64`.

    Returns:
        `(labels, probabilities)`: a list of label names and a float32 array of shape
        `(len(texts), num_classes)` whose rows sum to 1.

    Example:
    >>> labels, probs = predict(["What a film!"], run_dir="runs/x")  # doctest: +SKIP
    """
    import keras  # lazy: as keras_hub above

    if isinstance(texts, str):
        raise invalid_argument("texts", "a list of strings", texts)
    texts = list(texts)
    if model is None:
        if run_dir is None:
            raise ValueError("predict() needs `run_dir` or `model`.")
        model, names = load_exported(run_dir)
        class_names = class_names or names
    elif class_names is None and run_dir is not None:
        class_names = load_label_map(Path(run_dir) / EXPORT_DIR if (Path(run_dir) / EXPORT_DIR).is_dir() else run_dir)
    pre = model.preprocessor
    if pre is None:
        raise ValueError("predict() needs a model with its preprocessor attached (an exported model).")
    num_classes = int(model.num_classes)
    if not texts:
        return [], np.zeros((0, num_classes), np.float32)
    seq_len = int(pre.sequence_length)
    ds = make_eval_dataset(np.array(texts, dtype=object), None, pre, batch_size, seq_len).map(lambda x, y: x)
    model.preprocessor = None  # the pipeline has tokenised already
    try:
        out = model.predict(ds, verbose=0)
    finally:
        model.preprocessor = pre
    out = np.asarray(out, dtype=np.float32)
    if keras.activations.get(getattr(model, "activation", None)) is not keras.activations.softmax:
        out = np.exp(out - out.max(axis=-1, keepdims=True))
        out = out / out.sum(axis=-1, keepdims=True)
    names = list(class_names) if class_names is not None else [str(i) for i in range(num_classes)]
    return [names[i] for i in out.argmax(axis=-1)], out
