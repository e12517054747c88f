"""trainwell.runtime on Keras's JAX backend: `cpu:N` data parallelism through `keras.distribution`.

Each test runs a fresh interpreter with `KERAS_BACKEND=jax` (the backend is chosen when Keras
is imported, and `cpu:N` must set `XLA_FLAGS` before JAX starts).
"""

import json

import pytest

pytest.importorskip("jax", reason="JAX is not installed (pip install 'trainwell[jax]'); the JAX backend is not tested")

JAX_ENV = {"KERAS_BACKEND": "jax", "XLA_FLAGS": ""}


def _last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_cpu2_data_parallel_splits_the_batch_and_matches_one_device(python_subprocess):
    r = python_subprocess("""
    import json, sys, numpy as np, keras, jax
    from trainwell import runtime
    two = runtime.make_strategy("cpu:2")  # before any JAX computation
    one = runtime.make_strategy("one_device")
    seen = []  # the shard shape of the input batch inside the compiled train step

    class Probe(keras.layers.Layer):
        def call(self, x):
            jax.debug.inspect_array_sharding(x, callback=lambda s: seen.append(s.shard_shape(x.shape)))
            return x

    x = np.random.RandomState(0).randn(64, 8).astype("float32")
    y = (x[:, 0] + x[:, 1] > 0).astype("int32")
    start = None  # both runs start from the same weights (no seeding: it would import TensorFlow)

    def fit(strategy):
        global start
        with strategy.scope():
            model = keras.Sequential([keras.Input((8,)), Probe(), keras.layers.Dense(8, activation="relu"),
                                      keras.layers.Dense(2)])
            start = start or model.get_weights()
            model.set_weights(start)
            model.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            h = model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
        kernel = model.layers[1].kernel.value
        return h.history["loss"], len(kernel.sharding.device_set), model.get_weights()

    loss1, dev1, w1 = fit(one)
    shards1, seen[:] = list(seen), []
    loss2, dev2, w2 = fit(two)
    print(json.dumps({"replicas": [runtime.num_replicas(one), runtime.num_replicas(two)],
                      "devices": [dev1, dev2], "shards": [shards1[:1], seen[:1]], "loss": [loss1, loss2],
                      "dw": max(float(np.max(np.abs(a - b))) for a, b in zip(w1, w2)),
                      "outside": keras.distribution.distribution() is None,
                      "precision": runtime.resolve_precision("auto"), "tf": "tensorflow" in sys.modules}))
    """, env=JAX_ENV, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    out = _last_json(r.stdout)
    assert out["replicas"] == [1, 2] and out["devices"] == [1, 2], out
    assert out["shards"] == [[[16, 8]], [[8, 8]]], out  # the global batch of 16: 8 rows per device on cpu:2
    assert out["outside"], "scope() must restore the previous (no) distribution"
    assert out["precision"] == "float32" and not out["tf"], out  # the JAX path never loads TensorFlow
    l1, l2 = out["loss"]
    assert l1[-1] < l1[0] and all(abs(a - b) <= 1e-5 * max(1.0, abs(a)) for a, b in zip(l1, l2)), out["loss"]
    assert out["dw"] < 1e-5, out["dw"]


def test_one_device_and_too_late_for_cpu_n(monkeypatch):
    # In this process (JAX next to the suite's TensorFlow backend): JAX starts with one CPU device.
    import jax
    import jax.numpy as jnp

    from trainwell import runtime

    monkeypatch.setenv("XLA_FLAGS", "")  # ensure_host_devices writes it; restored after the test
    jnp.ones(2).block_until_ready()
    n = len(jax.local_devices(backend="cpu"))
    with pytest.raises(RuntimeError, match=rf"cpu:{n + 1}.*already initialised with {n}.*XLA_FLAGS"):
        runtime.ensure_host_devices(n + 1)
    s = runtime.make_jax_strategy("one_device")  # no distribution, like TensorFlow's default strategy
    assert s.distribution is None and runtime.num_replicas(s) == 1 and runtime.num_workers(s) == 1
    assert runtime.is_chief(s) and s.local_replica_ids() == [0]
    assert runtime.any_across_workers(s, [False, True]) == [False, True]
    assert runtime.any_across_workers(s, [False, False], flags_fn=lambda rid: [rid == 0, False]) == [True, False]
    with s.scope() as inside:
        assert inside is s
    with pytest.raises(ValueError, match="Received: strategy=3"):
        runtime.make_jax_strategy(3)
