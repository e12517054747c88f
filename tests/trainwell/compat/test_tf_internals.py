"""trainwell.compat.tf_internals: each accessor against the installed TensorFlow.

These fail when a private TensorFlow name moves or stops doing what trainwell relies on.
"""

import tensorflow as tf

from trainwell.compat import tf_internals as ti


def test_every_private_name_is_where_it_was():
    assert ti.audit() == []


def test_host_array_num_workers_and_global_generator():
    t = tf.constant([1.0, 2.0])
    assert ti.host_array(t).tolist() == [1.0, 2.0]
    assert ti.strategy_num_workers(tf.distribute.get_strategy()) is None
    g = tf.random.get_global_generator()
    assert ti.tf_global_generator() is g
    short = tf.data.Dataset.range(10).filter(lambda i: i != 3).batch(4)  # unknown length, last batch short
    assert int(short.cardinality()) == tf.data.UNKNOWN_CARDINALITY and ti.dataset_batch_size(short) == 4
    assert ti.dataset_batch_size(tf.data.Dataset.range(10)) is None  # not batched
    # No coordination service in one process: nothing to wait for. The multi-worker case (the read
    # fails once the chief is gone) is tests/trainwell/test_launch.py::test_cli_train_with_two_workers.
    assert ti.wait_for_coordination_leader(0.1) is False
