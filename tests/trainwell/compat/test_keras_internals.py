"""trainwell.compat.keras_internals: each accessor against the installed Keras (TF's: test_tf_internals.py).

These fail when an upstream name moves or stops doing what trainwell relies on.
"""

import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf

from trainwell.compat import keras_internals as ki
from trainwell.compat import versions


def _model(compile_it=True):
    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dropout(0.5, seed=1),
                          keras.layers.Dense(1)])
    if compile_it:
        m.compile(keras.optimizers.SGD(0.1), "mse", metrics=["mae"])
    return m


def test_every_private_name_is_where_it_was():
    assert ki.audit() == []


def test_audit_names_a_missing_name(monkeypatch):
    from keras.src.saving import saving_lib

    monkeypatch.delattr(saving_lib, "_walk_saveable")
    assert ki.audit() == ["saving_lib._walk_saveable"]
    with pytest.raises(versions.UpstreamChanged, match="saving_lib._walk_saveable"):
        ki.walk_saveables(_model(), set())


def test_walk_saveables_paths_are_those_of_keras_weights_h5(tmp_path):
    m = _model()
    path = tmp_path / "m.weights.h5"
    m.save_weights(path)
    with h5py.File(path, "r") as f:
        h5_paths = set()
        f.visit(lambda name: h5_paths.add(name.rsplit("/vars", 1)[0]) if name.endswith("/vars") else None)
    def own_vars(obj):
        store = {}
        if hasattr(obj, "save_own_variables"):
            obj.save_own_variables(store)
        return store

    ours = {p for p, obj in ki.walk_saveables(m, {id(m.optimizer)}) if own_vars(obj)}
    assert ours == {"layers/dense", "layers/dense_1"} and ours <= h5_paths


def test_fit_hooks_initial_epoch_loss_tracker_and_data():
    seen = {}

    class Probe(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            it = ki.fit_epoch_iterator(self.model)
            seen["source"] = ki.adapter_sample_source(it.data_adapter)
            ki.set_initial_epoch(self.model, 2)

        def on_epoch_end(self, epoch, logs=None):
            t = ki.loss_tracker(self.model)
            seen["tracker"] = float(t.total.numpy() / t.count.numpy())
            seen["loss"] = logs["loss"]

    m = _model()
    x, y = np.ones((8, 3), "float32"), np.zeros((8, 1), "float32")
    hist = m.fit(x, y, batch_size=4, epochs=3, verbose=0, callbacks=[Probe()])
    assert hist.epoch == [2]  # fit read the initial epoch set in on_train_begin
    kind, (inputs, n, bs) = seen["source"]
    assert kind == "arrays" and n == 8 and bs == 4 and np.asarray(inputs[0]).shape == (8, 3)
    assert seen["tracker"] == pytest.approx(seen["loss"])
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)

    class DsProbe(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            seen["ds"] = ki.adapter_sample_source(ki.fit_epoch_iterator(self.model).data_adapter)

    m.fit(ds, epochs=1, verbose=0, callbacks=[DsProbe()])
    assert seen["ds"][0] == "dataset" and isinstance(seen["ds"][1], tf.data.Dataset)


def test_symbolic_build_builds_model_and_metrics_from_an_element_spec():
    m = keras.Sequential([keras.layers.Dense(2)])
    m.compile("sgd", "mse", metrics=["mae"])
    assert not ki.model_fully_built(m)
    spec = tf.data.Dataset.from_tensor_slices((np.ones((4, 3), "float32"), np.ones((4, 2), "float32"))).batch(2)
    ki.symbolic_build(m, spec.element_spec)
    assert ki.model_fully_built(m) and not ki.compiled_metrics_unbuilt(m)


def test_loss_seeds_and_training_arg():
    m = _model()
    y, y_pred = np.ones((2, 1), "float32"), np.zeros((2, 1), "float32")
    assert float(ki.compute_loss(m, y=y, y_pred=y_pred)) == pytest.approx(1.0)
    assert ki.call_has_training_arg(m)
    assert len(ki.seed_generators(m.layers[1])) == 1
    state = ki.keras_global_seed_state(create=True)
    assert tuple(state.shape) == (2,) and ki.keras_global_seed_state() is state


def test_initial_epoch_default():
    assert ki.get_initial_epoch(_model()) is None


def test_optimizer_hooks_weight_decay_pass_exclusion_and_variable_index():
    class NoDecaySGD(ki.OwnWeightDecay, keras.optimizers.SGD):
        pass

    stepped = []
    for cls in (keras.optimizers.SGD, NoDecaySGD):  # a zero gradient: only the decay pass moves the weights
        a, bias = keras.Variable([1.0, 2.0]), keras.Variable([1.0], name="bias")
        opt = cls(0.1, weight_decay=0.5)
        opt.exclude_from_weight_decay(var_names=["bias"])
        opt.apply([keras.ops.zeros((2,)), keras.ops.zeros((1,))], [a, bias])
        stepped.append(a.numpy().tolist())
        assert (ki.uses_weight_decay(opt, a), ki.uses_weight_decay(opt, bias)) == (True, False)
        assert (ki.variable_index(opt, a), ki.variable_index(opt, bias)) == (0, 1)
        assert ki.variable_index(opt, bias.value) == 1  # the backend variable the TF backend passes to update_step
    assert stepped == [pytest.approx([0.95, 1.9]), [1.0, 2.0]]  # Keras decays through the name the mixin silences


def test_preset_backbone_class_reads_the_class_without_building(monkeypatch):
    # keras-hub's private preset loader (the one keras-hub name trainwell reads): the embedded MiniLM
    # preset is a BERT; the model-parallel strategy needs the class (its layout map) before any build.
    import keras_hub

    from trainwell.recipes.transformer_finetune import resolve_preset

    built = []
    monkeypatch.setattr(keras_hub.models.Backbone, "from_config", classmethod(lambda cls, *a, **k: built.append(cls)))
    assert ki.preset_backbone_class(resolve_preset("minilm")) is keras_hub.models.BertBackbone
    assert built == []
    assert versions.in_range(versions.keras_hub_version(), versions.TESTED_KERAS_HUB)
