"""Tests of trainwell.compat.replicas: which variables are per replica, and reading/writing every replica's copy.

The two-replica checks need TensorFlow split into 2 logical CPUs before its first
op, so they run in a fresh interpreter (`make_strategy("cpu:2")` first).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

from trainwell.compat import replicas


def test_per_replica_variables_are_batchnorms_moving_statistics():
    bn = keras.layers.BatchNormalization()
    bn.build((None, 3))
    assert [v.name for v in replicas.per_replica_variables(bn)] == ["moving_mean", "moving_variance"]
    bn.trainable = False  # a frozen BatchNorm: gamma and beta are not trainable now, still not per replica
    assert [v.name for v in replicas.per_replica_variables(bn)] == ["moving_mean", "moving_variance"]
    renorm = keras.layers.BatchNormalization(renorm=True)
    renorm.build((None, 3))
    assert {"moving_mean", "moving_variance", "moving_stddev"} <= {v.name for v in replicas.per_replica_variables(renorm)}
    dense = keras.layers.Dense(2)
    dense.build((None, 3))
    dense.trainable = False
    assert replicas.per_replica_variables(dense) == [] and replicas.per_replica_variables(object()) == []
    assert replicas.num_replicas(None) == 1


_TWO_REPLICAS = textwrap.dedent(
    """
    import json, sys
    from trainwell import runtime
    strategy = runtime.make_strategy("cpu:2")  # before any TF op
    import keras, numpy as np
    from trainwell.callbacks.checkpoint import Checkpoint, load_checkpoint, state
    from trainwell.compat import replicas

    keras.utils.set_random_seed(0)
    rs = np.random.RandomState(0)
    # Two halves of each batch that differ: each replica's BatchNorm sees other moments.
    x = np.concatenate([rs.randn(8, 4), 5 + 3 * rs.randn(8, 4)] * 4).astype("float32")
    y = rs.randn(64, 2).astype("float32")

    def build():
        with strategy.scope():
            m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4),
                                  keras.layers.BatchNormalization(momentum=0.5), keras.layers.Dense(2)])
            m.compile("sgd", "mse")
        return m

    def rows(m):
        return replicas.replica_reader(strategy, replicas.per_replica_variables(m.layers[1]))()

    out = {"replicas": replicas.num_replicas(strategy)}
    m = build()
    m.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0,
          callbacks=[Checkpoint(sys.argv[1], save_every="epoch", async_save=False)])
    trained = rows(m)
    out["differ"] = [bool(not np.array_equal(r[0], r[1])) for r in trained]

    # The metric accumulators (on-read sums) of a mid-epoch checkpoint: each replica gets its own back.
    plan = state.Plan(m, include_optimizer=False)
    metric_vars = [v for _, v in plan.metric_vars]
    sums = replicas.replica_reader(strategy, metric_vars)()
    arrays = {k: np.array(state.host(a)) for k, a in state.capture(plan, weights_only=False, include_metrics=True)[0].items()}
    m.reset_metrics()
    state.restore_vars(plan.metric_vars, arrays, "ckpt", "metrics", "metric:")
    out["metrics_differ"] = any(not np.array_equal(r[0], r[1]) for r in sums)
    out["metrics_restored"] = [bool(np.array_equal(a, b)) for a, b in zip(sums, replicas.replica_reader(strategy, metric_vars)())]

    m2 = build()
    load_checkpoint(sys.argv[1], m2)
    out["restored_equal"] = [bool(np.array_equal(a, b)) for a, b in zip(trained, rows(m2))]
    # Each replica evaluates its half of the data with its own statistics.
    out["eval"] = [m.evaluate(x, y, batch_size=16, verbose=0), m2.evaluate(x, y, batch_size=16, verbose=0)]

    # The writer puts each row on its replica (here: the rows swapped).
    variables = replicas.per_replica_variables(m2.layers[1])
    replicas.replica_writer(strategy, variables)([r[::-1] for r in trained])
    out["swapped"] = [bool(np.array_equal(a, b[::-1])) for a, b in zip(rows(m2), trained)]
    print("RESULT", json.dumps(out))
    """
)


@pytest.mark.slow
def test_a_checkpoint_keeps_every_replicas_batchnorm_statistics(tmp_path):
    # Keras 3's BatchNorm updates its moving statistics per replica (aggregation "none");
    # a checkpoint that kept only the first replica's copy gave both replicas that copy
    # on resume, and the resumed run's validation differed from the uninterrupted run's.
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    r = subprocess.run([sys.executable, "-c", _TWO_REPLICAS, str(tmp_path / "ckpt")], capture_output=True,
                       text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.split("RESULT", 1)[1])
    assert out["replicas"] == 2
    assert out["differ"] == [True, True]  # the replicas' statistics do differ
    assert out["restored_equal"] == [True, True]
    assert out["metrics_differ"] and out["metrics_restored"] and all(out["metrics_restored"])
    assert out["eval"][0] == out["eval"][1]
    assert out["swapped"] == [True, True]
