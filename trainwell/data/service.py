"""tf.data service: a local dispatcher and workers, and sending a pipeline's work to them.

`tf.data.experimental.service` runs a dataset's graph on worker processes (other CPU
hosts, or more processes of a big one) and streams its elements to the trainer over
gRPC. trainwell uses one processing mode, `ShardingPolicy.DYNAMIC` ("distributed
epoch"), and this is what an epoch means with it:

- **Each example once per pass.** The dispatcher splits the dataset's source (the
  records or arrays before any shuffle) and hands the splits to the workers as they
  ask; an iteration of the distributed dataset is a job that visits each source
  element exactly once, whatever the number of workers. (`ShardingPolicy.OFF` would
  make every worker produce the whole dataset: each example N times per epoch with N
  workers, wrong for training.)
- **One job per run, not per epoch.** A job's workers build the pipeline afresh, so a
  job per epoch would repeat the first epoch's seeded shuffle and augmentation every
  epoch (measured: identical batches with one worker). The image pipeline
  (`build_image_datasets(data_service=...)`) therefore sends `repeat()`ed passes as
  one endless job: each pass reshuffled and re-augmented as in-process, and an epoch
  is the next `steps_per_epoch` batches of that stream (Keras counts them). With one
  worker, where the batch size divides the examples, an epoch is one pass; otherwise
  the examples the in-process pipeline drops at an epoch's end start the next epoch
  instead. With several workers a pass's boundary is not an epoch's: one worker may
  start the next pass while another finishes this one, so an epoch can hold a few
  examples of the next pass in place of some of its own, which come in the next epoch.
- **Order not deterministic.** Which worker gets which split, and which worker's
  element reaches the trainer first, depends on timing.
- **Resume.** A resume with the service is exact in the epoch and in the number of
  steps trained (`Checkpoint` takes the trained batches from the stream), not in the
  examples' order: a bit-identical resume needs the in-process pipeline.

`start_local_service` starts a dispatcher and N workers on 127.0.0.1 (tests, one big
host); `trainwell data-service --workers N` does it from the command line. On several
hosts, start a `DispatchServer` on one and `WorkerServer`s on the others (see
docs/recipes.md); the trainer only needs the dispatcher's `grpc://HOST:PORT`.

Example:
>>> import tensorflow as tf
>>> with start_local_service(workers=2) as service:
...     ds = distribute(tf.data.Dataset.range(6), service.target)
...     sorted(int(x) for x in ds)
[0, 1, 2, 3, 4, 5]
"""

from __future__ import annotations

import re
import socket
import sys
import time
from typing import Any

from trainwell.data.base import DataError
from trainwell.validation import invalid_argument, is_int

__all__ = ["PROCESSING_MODE", "LocalService", "check_target", "distribute", "start_local_service"]

#: The processing mode of `distribute` (`ShardingPolicy.DYNAMIC`): each source element once per
#: epoch, order not deterministic.
PROCESSING_MODE = "distributed_epoch"

_TARGET_RE = re.compile(r"^grpc://(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(?P<port>[0-9]{1,5})$")


def check_target(target: Any, name: str = "data_service") -> str:
    """Checks a tf.data service address `grpc://HOST:PORT`; returns it, else raises a one-line ValueError.

    Args:
        target: The address to check.
        name: The argument's name in the message. Defaults to `"data_service"`.

    Example:
    >>> check_target("grpc://10.0.0.5:5050")
    'grpc://10.0.0.5:5050'
    >>> check_target("10.0.0.5:5050")
    Traceback (most recent call last):
    ...
    ValueError: Invalid value for argument `data_service`. Expected a tf.data service dispatcher address 'grpc://HOST:PORT' (port 1-65535). Received: data_service='10.0.0.5:5050'
    """
    m = _TARGET_RE.fullmatch(target) if isinstance(target, str) else None
    if m is None or not 1 <= int(m.group("port")) <= 65535:
        raise invalid_argument(name, "a tf.data service dispatcher address 'grpc://HOST:PORT' (port 1-65535)", target)
    return target


def check_reachable(target: str, timeout_s: float = 60.0) -> None:
    """Waits until something accepts connections at `target` (`grpc://HOST:PORT`), at most `timeout_s`.

    A dispatcher started beside the trainer (`trainwell data-service ... &`, a cluster's
    launcher) may come up seconds after it: the trainer waits, saying so once on stderr
    after 2 s. Nothing there after `timeout_s`: a one-line `DataError`. Without this
    check, a pipeline sent to an address where no dispatcher runs waited forever for its
    first element (tf.data retries the connection silently).

    Example:
    >>> check_reachable("grpc://127.0.0.1:1", timeout_s=0.1)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    trainwell.data.base.DataError: Cannot reach the tf.data service dispatcher at grpc://127.0.0.1:1 within 0.1 s (...): start one (`trainwell data-service`) or fix `data_service`.
    """
    m = _TARGET_RE.fullmatch(check_target(target))
    address = (m.group("host").strip("[]"), int(m.group("port")))
    start = time.monotonic()
    said = False
    while True:
        try:
            socket.create_connection(address, timeout=max(0.1, min(5.0, timeout_s))).close()
            return
        except OSError as e:
            waited = time.monotonic() - start
            if waited >= timeout_s:
                raise DataError(f"Cannot reach the tf.data service dispatcher at {target} within {timeout_s:g} s "
                                f"({e.strerror or e}): start one (`trainwell data-service`) or fix `data_service`.") \
                    from None
            if waited >= 2.0 and not said:
                print(f"trainwell: waiting up to {timeout_s:g} s for the tf.data service dispatcher at {target} ...",
                      file=sys.stderr, flush=True)
                said = True
            time.sleep(0.25)


class LocalService:
    """A tf.data service dispatcher and its workers in this process.

    The dispatcher listens on every interface of the machine (gRPC's default;
    TensorFlow's `DispatcherConfig` takes no address to bind), the workers tell it
    127.0.0.1: reachable from other hosts unless a firewall or a private network
    namespace keeps them out.

    Made by `start_local_service`. `target` is the dispatcher's `grpc://127.0.0.1:PORT`;
    `stop()` (or leaving the `with` block) stops the workers, then the dispatcher.

    Args:
        dispatcher: The `tf.data.experimental.service.DispatchServer`.
        workers: Its `WorkerServer`s.

    Example:
    >>> with start_local_service(workers=1) as service:
    ...     service.target.startswith("grpc://127.0.0.1:")
    True
    """

    def __init__(self, dispatcher, workers) -> None:
        self.dispatcher = dispatcher
        self.workers = list(workers)
        port = dispatcher.target.rpartition(":")[2]
        self.target = f"grpc://127.0.0.1:{port}"

    def stop(self) -> None:
        """Stops the workers, then the dispatcher (idempotent)."""
        from trainwell.compat.tf_internals import stop_data_service_server  # lazy: it imports TensorFlow

        for w in self.workers:
            stop_data_service_server(w)
        self.workers = []
        if self.dispatcher is not None:
            stop_data_service_server(self.dispatcher)
            self.dispatcher = None

    def join(self) -> None:
        """Blocks until the dispatcher stops (the `trainwell data-service` command waits here)."""
        self.dispatcher.join()

    def __enter__(self) -> "LocalService":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_local_service(workers: int = 1, port: int = 0) -> LocalService:
    """Starts a tf.data service dispatcher and `workers` workers on 127.0.0.1.

    Args:
        workers: Number of worker servers, >= 1. Defaults to `1`.
        port: The dispatcher's port; `0` picks a free one. Defaults to `0`. The workers
            always take free ports.

    Returns:
        A `LocalService` (a context manager) whose `target` goes to `distribute` or to the
        ResNet recipe's `data_service`.

    Example:
    >>> service = start_local_service(workers=2)
    >>> len(service.workers)
    2
    >>> service.stop()
    """
    if not is_int(workers) or workers < 1:
        raise invalid_argument("workers", "an int >= 1", workers)
    if not is_int(port) or not 0 <= port <= 65535:
        raise invalid_argument("port", "an int in [0, 65535] (0: a free port)", port)
    if port:  # gRPC shares a port (SO_REUSEPORT): a second dispatcher on it would start and split the traffic
        with socket.socket() as probe:
            try:
                probe.bind(("", int(port)))
            except OSError as e:
                raise invalid_argument("port", f"a free port ({e.strerror})", port) from None
    import tensorflow as tf  # lazy: a config checks its `data_service` address (`check_target`) without TensorFlow

    from trainwell.compat.tf_internals import stop_data_service_server  # lazy: it imports TensorFlow, as above

    svc = tf.data.experimental.service
    dispatcher = svc.DispatchServer(svc.DispatcherConfig(port=int(port)))
    address = "127.0.0.1:" + dispatcher.target.rpartition(":")[2]
    started = []
    try:
        for _ in range(int(workers)):
            started.append(svc.WorkerServer(svc.WorkerConfig(
                dispatcher_address=address, worker_address="127.0.0.1:%port%", port=0)))
    except Exception:
        for w in started:
            stop_data_service_server(w)
        stop_data_service_server(dispatcher)
        raise
    return LocalService(dispatcher, started)


def distribute(dataset: "tf.data.Dataset", target: str, job_name: str | None = None) -> "tf.data.Dataset":
    """`dataset`, produced by the tf.data service at `target` in `PROCESSING_MODE` (DYNAMIC).

    Each iteration of the result is a job (a named one is shared by the trainers that
    use the same `job_name`) that reads every element of `dataset`'s source once,
    split across the workers, in an order that is not deterministic (see the module
    docstring). `dataset`'s source must be splittable (ranges, tensor slices, files
    read with `TFRecordDataset`...): tf.data raises at the first iteration otherwise.

    Args:
        dataset: The `tf.data.Dataset` whose graph the workers run.
        target: The dispatcher, `"grpc://HOST:PORT"`.
        job_name: Name of a job shared between trainers. Defaults to `None` (a new
            anonymous job per iteration).

    Returns:
        The distributed `tf.data.Dataset` (its cardinality is unknown).

    Example:
    >>> import tensorflow as tf
    >>> with start_local_service(workers=1) as service:
    ...     len(list(distribute(tf.data.Dataset.range(4).map(lambda x: x * 2), service.target)))
    4
    """
    import tensorflow as tf  # lazy, as in `start_local_service`

    if not isinstance(dataset, tf.data.Dataset):
        raise invalid_argument("dataset", "a tf.data.Dataset", dataset)
    check_target(target, "target")
    check_reachable(target)
    if job_name is not None and (not isinstance(job_name, str) or not job_name):
        raise invalid_argument("job_name", "None or a non-empty str", job_name)
    return dataset.apply(tf.data.experimental.service.distribute(
        processing_mode=PROCESSING_MODE, service=target, job_name=job_name))
