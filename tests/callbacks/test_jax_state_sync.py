"""The recipe's per-step callbacks on Keras's JAX backend leave the training state where `fit` keeps it.

On JAX, reading Keras's `Callback.model` inside `fit` writes the whole state back into the
variables (`jax_state_sync`) and the next step reads it back: on an H200 that cost the recipe's
callback stack about 20 ms a step of host time for ResNet-50 (bench/README.md). Per-step hooks
read the model through `compat.backend.callback_model`; values come from the live state.
"""

import json

import pytest

pytest.importorskip("jax", reason="JAX is not installed (pip install 'trainwell[jax]'); the JAX backend is not tested")


def test_per_step_hooks_do_not_sync_the_jax_state(python_subprocess, tmp_path):
    r = python_subprocess(f"""
    import json, numpy as np, keras
    from trainwell.callbacks import Checkpoint, EarlyStopping, NaNRollback, TrainingDoctor
    keras.mixed_precision.set_global_policy("mixed_float16")  # a LossScaleOptimizer: the doctor tracks its scale

    def syncs(steps):
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.01), "mse")
        calls = []
        sync = model.jax_state_sync
        def counted():
            calls.append(1)
            sync()
        model.jax_state_sync = counted
        x = np.random.default_rng(0).normal(size=(8 * steps, 4)).astype("float32")
        stack = [NaNRollback(), Checkpoint({str(tmp_path)!r} + f"/ckpt{{steps}}", verbose=0),
                 TrainingDoctor(verbose=0), EarlyStopping(monitor="loss", patience=5)]
        model.fit(x, x.sum(1), batch_size=8, epochs=1, verbose=0, callbacks=stack)
        return len(calls)

    print(json.dumps({{"syncs": [syncs(4), syncs(28)]}}))
    """, env={"KERAS_BACKEND": "jax"}, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    short, long = json.loads(r.stdout.strip().splitlines()[-1])["syncs"]
    # Per fit and per epoch (Keras's epoch end, the epoch-end save, the first probe), never per step:
    # 24 more steps, no more syncs.
    assert long == short, (short, long)
