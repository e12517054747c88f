"""trainwell.compat.learning_rate: the one LR get/set, against Keras's optimizer internals."""

import keras
import numpy as np
import pytest

from trainwell.callbacks.schedules import WarmupCosineDecay
from trainwell.compat import UpstreamChanged
from trainwell.compat import learning_rate as lr


def test_raw_set_replaces_the_lr_without_changing_the_variable_list():
    opt = keras.optimizers.SGD(0.1, momentum=0.9)
    opt.build([keras.Variable([1.0])])
    names = [v.path for v in opt.variables]
    old = lr.set_raw_learning_rate(keras.optimizers.LossScaleOptimizer(opt), WarmupCosineDecay(0.4, 10))
    assert lr.learning_rate_variables(opt) == [] and isinstance(old, keras.Variable)
    assert lr.current_lr(opt) == pytest.approx(0.4) and [v.path for v in opt.variables] == names
    lr.set_raw_learning_rate(opt, old)
    assert lr.learning_rate_variables(opt) == [old] and lr.current_lr(opt) == pytest.approx(0.1)


def test_install_schedule_hands_over_the_pending_multiplier():
    opt = keras.optimizers.SGD(0.1)
    lr.set_lr_multiplier(opt, 0.5)
    assert lr.current_lr(opt) == pytest.approx(0.1)  # a plain LR is not changed by a multiplier
    lr.install_schedule(opt, WarmupCosineDecay(0.2, 100))
    assert lr.get_lr_multiplier(opt) == 0.5 and lr.current_lr(opt) == pytest.approx(0.1)
    second = WarmupCosineDecay(0.4, 100)
    lr.install_schedule(opt, second)  # the multiplier in force carries over
    assert float(second.multiplier.numpy()) == 0.5
    with pytest.raises(ValueError, match="Expected a LearningRateSchedule with a `multiplier`"):
        lr.install_schedule(opt, keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5))


def test_a_renamed_keras_attribute_is_reported(monkeypatch):
    opt = keras.optimizers.SGD(0.1)
    monkeypatch.delattr(opt, "_learning_rate")
    with pytest.raises(UpstreamChanged, match="Optimizer._learning_rate"):
        lr.raw_learning_rate(opt)


def test_live_schedule_variables_says_whether_a_traced_step_reads_the_schedules_variables():
    """One weight, loss = w (gradient 1): plain SGD moves w by the LR the traced step used."""

    class VariableLR(keras.optimizers.schedules.LearningRateSchedule):
        def __init__(self):
            self.lr = keras.Variable(0.1, trainable=False)

        def __call__(self, step):
            return self.lr * 1.0

    schedule = VariableLR()
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
    model.compile(keras.optimizers.SGD(schedule), lambda y, p: keras.ops.mean(p))
    x, y = np.ones((1, 1), "float32"), np.zeros((1, 1), "float32")
    model.fit(x, y, batch_size=1, epochs=1, verbose=0)
    schedule.lr.assign(0.2)
    model.fit(x, y, batch_size=1, epochs=1, verbose=0)  # the same traced train step
    moved = -float(model.trainable_weights[0].numpy().ravel()[0]) - 0.1
    assert (moved == pytest.approx(0.2)) is lr.live_schedule_variables(), moved
