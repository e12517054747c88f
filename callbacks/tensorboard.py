"""`TensorBoard`: Keras's, without its per-batch summary calls when nothing would record them."""

from __future__ import annotations

import keras


class TensorBoard(keras.callbacks.TensorBoard):
    """Keras's `TensorBoard`, minus the per-batch summary calls that record nothing.

    Extends `keras.callbacks.TensorBoard`, which at `update_freq="epoch"` (its
    default, and the recipes') pushes no summary writer for batches, yet calls
    `summary.scalar` for every value of every batch's logs in
    `on_train_batch_end`: each call records nothing, after a fraction of a
    millisecond of Python per step (figures: bench/README.md,
    callback_overhead). This class skips those calls when
    `tf.summary.should_record_summaries()` says nothing would be written (no
    default writer); with one (a `writer.as_default()` around `fit`, or
    `update_freq=N`, for which Keras pushes its own), it records exactly what
    Keras records, the same summaries at the same steps. Everything else
    (epoch summaries, graphs, histograms, the profiler) is Keras's, unchanged.
    Keras's own tests for `TensorBoard` run against this class
    (`tests/conformance/`).

    Args:
        **kwargs: Keras's `TensorBoard` arguments, unchanged.

    Example:
    >>> import tempfile, keras, numpy as np
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> model.compile("sgd", "mse")
    >>> tb = TensorBoard(log_dir=tempfile.mkdtemp())
    >>> model.fit(np.ones((8, 2)), np.ones((8, 1)), epochs=2, callbacks=[tb], verbose=0).epoch
    [0, 1]
    """

    def on_train_batch_end(self, batch, logs=None):
        if logs and not self._batch_summaries_recorded():
            logs = None  # Keras writes each value of the logs with `summary.scalar`: nothing would be recorded
        super().on_train_batch_end(batch, logs)

    def _batch_summaries_recorded(self) -> bool:
        """Whether a summary written now would be recorded (a default writer is set and records)."""
        return bool(self.summary.should_record_summaries())
