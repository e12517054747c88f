import tensorflow as tf

from trainwell.compat.devices import on_accelerator


def test_on_accelerator_reads_the_strategys_devices():
    assert on_accelerator() is False  # the test machines: CPUs only
    with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
        assert on_accelerator() is False
    # A strategy placed on a GPU (built without one: only its device names are read).
    with tf.distribute.OneDeviceStrategy("/gpu:0").scope():
        assert on_accelerator() is True
