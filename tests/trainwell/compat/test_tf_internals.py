"""trainwell.compat.tf_internals: each accessor against the installed TensorFlow.

These fail when a private TensorFlow name moves or stops doing what trainwell relies on.
"""

import gc

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


def test_waiting_for_the_leader_never_holds_one_read_pending_on_it(monkeypatch):
    """Short reads (none left pending on the leader for long), until the leader is gone; a refused read
    ends the wait."""
    from tensorflow.python.eager import context

    class Ctx:
        coordination_service = object()  # configured, as in a multi-worker job
        reads: list = []

        def get_config_key_value(self, key, timeout_in_ms=0):
            self.reads.append(timeout_in_ms)
            if len(self.reads) < 4:  # the leader is still there
                raise tf.errors.DeadlineExceededError(None, None, "timed out")
            raise tf.errors.UnavailableError(None, None, "leader gone")

    monkeypatch.setattr(context, "context", lambda: Ctx())
    assert ti.wait_for_coordination_leader(60.0) is True
    assert len(Ctx.reads) == 4 and max(Ctx.reads) <= 1000

    class Refused(Ctx):
        def get_config_key_value(self, key, timeout_in_ms=0):
            raise tf.errors.CancelledError(None, None, "shutting down")

    monkeypatch.setattr(context, "context", lambda: Refused())
    assert ti.wait_for_coordination_leader(60.0) is False


def test_seeding_clears_the_kernel_caches_except_within_kernel_caches_kept(tf_cache_clears):
    """TensorFlow's reseeding clears the caches (what costs the re-instantiation); the block keeps them
    and seeds exactly as without it (the same operation seeds after it)."""
    from tensorflow.python.eager import context

    clears = tf_cache_clears
    tf.random.set_seed(7)
    assert len(clears) == 1  # upstream still clears: else kernel_caches_kept has nothing to do
    plain = [context.context()._internal_operation_seed() for _ in range(3)]
    with ti.kernel_caches_kept():
        tf.random.set_seed(7)
        kept = [context.context()._internal_operation_seed() for _ in range(3)]
        assert context.context()._seed == 7
    assert len(clears) == 1 and kept == plain
    tf.random.set_seed(7)  # the patch is gone after the block
    assert len(clears) == 2


def test_stateful_random_functions_finds_the_functions_whose_kernels_hold_random_state():
    @tf.function(autograph=False)
    def stateful(x):
        return x + tf.random.uniform([2])

    @tf.function(autograph=False)
    def stateless(x):
        return x + tf.random.stateless_uniform([2], seed=[1, 2])

    stateless(tf.constant(1.0))
    assert not any("stateless" in name for name in ti.stateful_random_functions())
    stateful(tf.constant(1.0))
    assert any("stateful" in name for name in ti.stateful_random_functions())
    del stateful  # TensorFlow removes a deleted function's graphs from the context: found no more
    gc.collect()
    assert not any("stateful" in name for name in ti.stateful_random_functions())
