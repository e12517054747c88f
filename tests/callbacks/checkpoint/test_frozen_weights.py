"""`Checkpoint(frozen_weights=...)`: checkpoints without the weights training leaves alone (LoRA's base).

A run stopped and resumed from such a checkpoint, in a model rebuilt with the same frozen weights,
ends bit-identical to an uninterrupted run; the checkpoint holds no frozen array; a model with other
frozen weights, or a "frozen" weight that training changes, is refused in one message.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

from trainwell.callbacks.checkpoint import (
    Checkpoint,
    CheckpointMismatchError,
    list_checkpoints,
    load_checkpoint,
)
from trainwell.callbacks.checkpoint.files import read_checkpoint

RS = np.random.RandomState(0)
X = RS.randn(32, 6).astype("float32")
Y = (X @ RS.randn(6, 1)).astype("float32")


def _model(frozen_seed=1, train_seed=2, batchnorm=False):
    """A frozen 'pretrained' Dense (weights from `frozen_seed`) under a trainable head."""
    keras.utils.set_random_seed(frozen_seed)
    base = keras.layers.Dense(16, activation="tanh", name="base")
    layers = [keras.Input((6,)), base]
    if batchnorm:
        layers.append(keras.layers.BatchNormalization(name="bn"))
    model = keras.Sequential(layers)
    base.trainable = False
    keras.utils.set_random_seed(train_seed)
    model.add(keras.layers.Dense(1, name="head"))
    model.compile(keras.optimizers.Adam(0.05), loss="mse")
    return model


def _fit(model, directory, epochs, **kw):
    ckpt = Checkpoint(directory, verbose=0, frozen_weights=kw.pop("frozen_weights", "non_trainable"), **kw)
    model.fit(X, Y, batch_size=8, epochs=epochs, shuffle=False, verbose=0, callbacks=[ckpt])
    return ckpt


def _weights(model):
    return [np.asarray(w) for w in model.get_weights()]


def test_resume_without_frozen_arrays_is_bit_identical(tmp_path):
    full = _model()
    _fit(full, tmp_path / "full", 3)
    part = _model()
    _fit(part, tmp_path / "part", 2)
    entry = list_checkpoints(tmp_path / "part")[-1]
    meta, arrays = read_checkpoint(entry["path"])
    assert not any(k.startswith("model:layers/dense/") for k in arrays)  # the frozen base: kernel, bias
    assert any(k.startswith("model:layers/dense_1/") for k in arrays)
    assert sorted(meta["frozen"]) == ["model:layers/dense/0", "model:layers/dense/1"]
    resumed = _model()  # a new process would rebuild the same frozen weights (the preset)
    _fit(resumed, tmp_path / "part", 3)
    for a, b in zip(_weights(full), _weights(resumed)):
        np.testing.assert_array_equal(a, b)


def test_other_frozen_weights_are_refused_on_resume_and_load(tmp_path):
    _fit(_model(), tmp_path / "run", 1)
    other = _model(frozen_seed=7)
    with pytest.raises(CheckpointMismatchError, match=r"frozen weights.*model:layers/dense/0.*same pretrained"):
        _fit(other, tmp_path / "run", 2)
    with pytest.raises(CheckpointMismatchError, match="frozen weights"):
        load_checkpoint(tmp_path / "run", _model(frozen_seed=7))
    same = _model()
    load_checkpoint(tmp_path / "run", same)
    trained = _model()
    _fit(trained, tmp_path / "again", 1)
    for a, b in zip(_weights(trained), _weights(same)):
        np.testing.assert_array_equal(a, b)


def test_a_frozen_weight_that_training_changes_is_refused(tmp_path):
    # BatchNorm's moving statistics are non-trainable yet updated: "non_trainable" must not drop them.
    model = _model(batchnorm=True)
    with pytest.raises(ValueError, match=r"changed during training.*batch_normalization"):
        _fit(model, tmp_path / "run", 1)
    ok = _model(batchnorm=True)  # the paths of what is really frozen
    _fit(ok, tmp_path / "ok", 1, frozen_weights=[w.path for w in ok.get_layer("base").weights])
    assert any(k.startswith("model:layers/batch_normalization") for k in read_checkpoint(list_checkpoints(tmp_path / "ok")[-1]["path"])[1])


@pytest.mark.parametrize("bad", ["all", [""], 3, ["base/kernel", 1]])
def test_bad_frozen_weights_are_refused_at_construction(tmp_path, bad):
    with pytest.raises(ValueError, match=r"frozen_weights.*Received"):
        Checkpoint(tmp_path, frozen_weights=bad)


def test_unknown_paths_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"not weights of .*'base/kernl'"):
        _fit(_model(), tmp_path, 1, frozen_weights=["base/kernl"])
