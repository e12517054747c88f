"""trainwell.compat.kernels: each capability holds on its backend (TensorFlow here, JAX in a subprocess).

`train_step_reads_outside_variables()` is checked against what Keras's compiled train
step does with a loss's own variable (an assignment reaches the next step, or is
baked in); `has_fused_batch_norm_kernel()`/`fused_batch_norm` against Keras's
BatchNormalization's numbers. Each fails when the backend stops behaving as the
capability says (then the layers and losses that ask it are wrong).
"""

import contextlib
import io
import json

import keras
import numpy as np
import pytest

from trainwell.compat.kernels import fused_batch_norm, has_fused_batch_norm_kernel

# A compiled Dense model whose loss adds a variable outside the model's state: the
# loss of one step on a zero weight and a zero input is that variable's value.
_STEP_READS = """
import keras, numpy as np
from trainwell.compat.kernels import train_step_reads_outside_variables
offset = keras.Variable(1.0, trainable=False)
model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, kernel_initializer="zeros")])
model.compile("sgd", loss=lambda y, p: keras.ops.mean(p) * 0.0 + offset)  # JAX: jitted, as fit compiles it
x = np.zeros((2, 1), "float32")
first = float(model.train_on_batch(x, x))
offset.assign(5.0)
second = float(model.train_on_batch(x, x))
print(__import__("json").dumps({"capability": train_step_reads_outside_variables(), "losses": [first, second]}))
"""


def _seen(result: dict) -> bool:
    """Whether the second step saw the assignment (loss 5.0) or kept the traced value (1.0)."""
    assert result["losses"][0] == 1.0
    assert result["losses"][1] in (1.0, 5.0)
    return result["losses"][1] == 5.0


def test_train_step_reads_outside_variables_on_tensorflow():
    scope: dict = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(_STEP_READS, scope)
    result = json.loads(out.getvalue())
    assert result["capability"] is True
    assert _seen(result)


def test_train_step_reads_outside_variables_on_jax(python_subprocess):
    pytest.importorskip("jax", reason="JAX is not installed; the JAX backend is not tested")
    r = python_subprocess(_STEP_READS, env={"KERAS_BACKEND": "jax"})
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["capability"] is False
    assert not _seen(result)


@pytest.mark.parametrize("training", [True, False], ids=["training", "inference"])
def test_fused_batch_norm_matches_keras_batch_normalization(training):
    assert has_fused_batch_norm_kernel()
    rs = np.random.RandomState(0)
    x = rs.randn(4, 3, 3, 5).astype("float32")
    gamma, beta = rs.rand(5).astype("float32") + 0.5, rs.randn(5).astype("float32")
    mean, var = rs.randn(5).astype("float32"), rs.rand(5).astype("float32") + 0.5
    bn = keras.layers.BatchNormalization(momentum=0.0, epsilon=1e-3)
    bn.build(x.shape)
    bn.set_weights([gamma, beta, mean, var])
    expected = np.asarray(bn(x, training=training))
    if training:
        y, m, v = fused_batch_norm(x, gamma, beta, 1e-3)
        # momentum 0: Keras's moving moments are the batch's (the biased variance)
        np.testing.assert_allclose(np.asarray(m), np.asarray(bn.moving_mean), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(v), np.asarray(bn.moving_variance), rtol=1e-5, atol=1e-6)
    else:
        y, m, v = fused_batch_norm(x, gamma, beta, 1e-3, mean=mean, variance=var)
        assert m is None and v is None
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-5, atol=1e-5)
