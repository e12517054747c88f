import json
import os

import keras
import numpy as np
import pytest

from trainwell import runtime
from trainwell.compat import distribution


_TINY_FIT = """
    import json, numpy as np, keras
    from trainwell import runtime
    strategy = runtime.make_strategy({strategy!r})
    policy = runtime.set_precision({precision!r})
    runtime.seed_everything(0)
    x = np.random.RandomState(0).randn(256, 8).astype("float32")
    y = (x[:, 0] + x[:, 1] > 0).astype("int32")
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(2), keras.layers.Activation("softmax", dtype="float32")])
        model.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy", metrics=["accuracy"])
    h = model.fit(x, y, batch_size=32, epochs=3, verbose=0)
    out = {{"replicas": strategy.num_replicas_in_sync, "policy": policy,
            "kernel_dtype": model.layers[0].kernel.dtype, "compute": model.layers[0].compute_dtype,
            "opt": type(model.optimizer).__name__,
            "loss": h.history["loss"], "acc": h.history["accuracy"][-1]}}
    """


def _last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.slow
def test_mirrored_fit_over_two_logical_cpus_and_no_other_count_after_start_up(python_subprocess):
    # One interpreter: `cpu:N` must come before TensorFlow sets up its devices, so both
    # halves need a fresh one. After the fit the devices exist: another count is an error.
    r = python_subprocess(_TINY_FIT.format(strategy="cpu:2", precision="float32") + """
    try:
        runtime.make_strategy("cpu:3")
    except RuntimeError as e:
        out["error"] = str(e)
    print(json.dumps(out))
    """)
    assert r.returncode == 0, r.stderr[-3000:]
    out = _last_json(r.stdout)
    assert out["replicas"] == 2
    assert out["loss"][-1] < out["loss"][0]
    assert out["acc"] > 0.8
    assert "cpu:3" in out["error"] and "before" in out["error"]


def test_mixed_float16_fit_on_cpu():
    import textwrap

    scope, before = {}, keras.mixed_precision.global_policy().name
    try:  # in this process: the precision is Keras's global policy, put back below
        exec(textwrap.dedent(_TINY_FIT.format(strategy="auto", precision="mixed_float16")), scope)
    finally:
        keras.mixed_precision.set_global_policy(before)
    out = scope["out"]
    assert out["policy"] == "mixed_float16"
    assert out["kernel_dtype"] == "float32" and out["compute"] == "float16"
    assert out["opt"] == "LossScaleOptimizer"  # Keras wraps it under mixed_float16
    assert out["loss"][-1] < out["loss"][0]


@pytest.mark.parametrize("spec", ["gpu", "cpu:0", "cpu:x", "", 3, None])
def test_invalid_strategy_spec(spec):
    with pytest.raises(ValueError, match="Received: strategy="):
        runtime.make_strategy(spec)


def test_auto_strategy_on_cpu_is_default():
    import tensorflow as tf

    s = runtime.make_strategy("auto")
    assert runtime.num_replicas(s) == 1
    assert s is tf.distribute.get_strategy()
    assert runtime.make_strategy(s) is s


def test_auto_picks_multiworker_from_tf_config(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
                                                "task": {"type": "worker", "index": 1}}))
    assert distribution.tf_config_cluster() is not None
    assert runtime.is_chief() is False
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["127.0.0.1:1"]}, "task": {"type": "worker", "index": 0}}))
    assert distribution.tf_config_cluster() is None
    assert runtime.is_chief() is True
    monkeypatch.setenv("TF_CONFIG", "{not json")
    with pytest.raises(ValueError, match="TF_CONFIG"):
        distribution.tf_config_cluster()


def test_precision_specs():
    assert runtime.resolve_precision("auto") == "float32"  # CPU-only machine
    for p in ("float32", "mixed_float16", "mixed_bfloat16"):
        assert runtime.resolve_precision(p) == p
    with pytest.raises(ValueError, match="Received: precision='fp16'"):
        runtime.set_precision("fp16")
    try:
        assert runtime.set_precision("mixed_bfloat16") == "mixed_bfloat16"
        assert keras.mixed_precision.global_policy().name == "mixed_bfloat16"
    finally:
        runtime.set_precision("float32")


def test_seed_everything_reproducible():
    import tensorflow as tf

    runtime.seed_everything(7)
    a = (np.random.rand(3), float(keras.random.uniform(())), float(tf.random.uniform(())))
    runtime.seed_everything(7)
    b = (np.random.rand(3), float(keras.random.uniform(())), float(tf.random.uniform(())))
    assert np.allclose(a[0], b[0]) and a[1] == b[1] and a[2] == b[2]
    with pytest.raises(ValueError, match="Received: seed=-1"):
        runtime.seed_everything(-1)
    runtime.seed_everything(2**32 - 1)  # NumPy's largest seed
    with pytest.raises(ValueError, match=r"Expected an int in \[0, 2\*\*32 - 1\].*Received: seed=4294967296"):
        runtime.seed_everything(2**32)  # NumPy would raise deep inside keras.utils.set_random_seed


def test_a_bad_strategy_is_refused_without_loading_keras(python_subprocess):
    # trainwell.config checks a strategy with this before anything trains: a typo is answered at once.
    r = python_subprocess("""
    import sys
    from trainwell import runtime
    for bad in (3, "cpu:0", "gpu"):
        try:
            runtime.validate_strategy_spec(bad)
        except ValueError as e:
            print("REFUSED", str(e).split("Received: ")[1])
    print("LOADED", sorted(m for m in ("keras", "tensorflow", "jax") if m in sys.modules))
    """)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("REFUSED") == 3 and "strategy=3" in r.stdout, r.stdout
    assert "LOADED []" in r.stdout, r.stdout
