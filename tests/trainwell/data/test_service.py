"""tf.data service (trainwell.data.service): a local dispatcher and workers, DYNAMIC epochs, the image pipeline."""

import collections
import os
import socket

import numpy as np
import pytest
import tensorflow as tf

from trainwell.data.base import DataError
from trainwell.data.images import build_image_datasets
from trainwell.data.service import PROCESSING_MODE, check_reachable, check_target, distribute, start_local_service


@pytest.fixture(scope="module")
def service():
    with start_local_service(workers=2) as s:
        yield s


def test_one_epoch_through_two_workers_yields_each_example_once_and_each_epoch_again(service):
    assert PROCESSING_MODE == "distributed_epoch"  # tf.data's name of ShardingPolicy.DYNAMIC
    ds = distribute(tf.data.Dataset.range(40).shuffle(40, seed=1).map(lambda x: x * 3), service.target)
    for _ in range(2):  # every iteration is a new job: one more epoch, each example once again
        got = [int(x) for x in ds]
        assert sorted(got) == [3 * i for i in range(40)]


def test_local_service_stops_and_arguments_are_refused():
    s = start_local_service(workers=1)
    assert s.target.startswith("grpc://127.0.0.1:") and int(s.target.rpartition(":")[2]) > 0
    s.stop()
    s.stop()  # idempotent
    with pytest.raises(ValueError, match=r"Received: workers=0"):
        start_local_service(workers=0)
    with pytest.raises(ValueError, match=r"Received: port=70000"):
        start_local_service(workers=1, port=70000)


def test_a_port_in_use_and_an_address_with_no_dispatcher_are_one_line_each(service):
    port = int(service.target.rpartition(":")[2])
    # gRPC shares a port (SO_REUSEPORT): a second dispatcher there started and split the traffic
    with pytest.raises(ValueError, match=rf"Expected a free port \(.*\). Received: port={port}"):
        start_local_service(workers=1, port=port)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    # without the check, the pipeline waited forever for its first element
    with pytest.raises(DataError, match=rf"Cannot reach the tf.data service dispatcher at grpc://127.0.0.1:{free} "
                                        r"within 1 s"):
        check_reachable(f"grpc://127.0.0.1:{free}", timeout_s=1)
    check_reachable(service.target, timeout_s=1)  # a dispatcher there: no wait


@pytest.mark.parametrize("bad", ["localhost:5000", "grpc://host", "grpc://host:0", "grpc://host:99999",
                                 "http://host:5000", "grpc://a b:1", 5000, None, "grpc://host:5000\n"])
def test_check_target_refuses_in_one_line(bad):
    with pytest.raises(ValueError) as e:
        check_target(bad)
    assert "Received: data_service=" in str(e.value) and "\n" not in str(e.value).replace("\\n", "")


def test_check_target_accepts_host_port():
    assert check_target("grpc://worker-0.example.com:5050") == "grpc://worker-0.example.com:5050"
    assert check_target("grpc://[::1]:5050") == "grpc://[::1]:5050"


def test_distribute_refuses_a_non_dataset_and_a_bad_job_name(service):
    with pytest.raises(ValueError, match="Received: dataset="):
        distribute([1, 2], service.target)
    with pytest.raises(ValueError, match="Received: job_name=''"):
        distribute(tf.data.Dataset.range(2), service.target, job_name="")


@pytest.fixture(scope="module")
def shaded_folder(tmp_path_factory):
    """2 classes x 6 JPEGs of 8x8 px, each a flat grey of its own level: an image's mean names it."""
    root = tmp_path_factory.mktemp("shades")
    for c in range(2):
        os.makedirs(root / f"c{c}")
        for i in range(6):
            level = 20 + 35 * (6 * c + i) // 2
            pixels = np.full((8, 8, 3), level, np.uint8)
            (root / f"c{c}" / f"{i}.jpg").write_bytes(tf.io.encode_jpeg(pixels, quality=100).numpy())
    return root


def _epoch_images(iterator, batches):
    """The (rounded mean, label) of each image of the next `batches` batches, in order."""
    out = []
    for _ in range(batches):
        images, labels = next(iterator)
        out += [(float(m), int(y)) for m, y in zip(np.round(images.numpy().mean(axis=(1, 2, 3)), 3),
                                                   labels.numpy().argmax(-1))]
    return out


def test_image_pipeline_through_the_service_trains_each_example_once_per_pass(shaded_folder):
    # One worker: an epoch is exactly one pass. With several, a worker may start the next pass while
    # another finishes this one, so an epoch's boundary is not a pass's (a CI run saw it with 2
    # workers; the module docstring says so); each pass still has each example once
    # (`test_one_epoch_through_two_workers_...`).
    kwargs = dict(augment="none", val_fraction=0.0, test_fraction=0.0, seed=3)
    local = build_image_datasets(f"folder:{shaded_folder}", 8, 4, **kwargs)
    with start_local_service(workers=1) as one:
        remote = build_image_datasets(f"folder:{shaded_folder}", 8, 4, data_service=one.target, **kwargs)
        assert local.steps["train"] == 3  # 12 images, batches of 4: an epoch is one pass
        assert int(remote.train.cardinality()) == tf.data.INFINITE_CARDINALITY  # one job; Keras counts the steps
        expected = collections.Counter(_epoch_images(iter(local.train), 3))
        assert sum(expected.values()) == 12 and len(expected) == 12  # 12 distinct images
        stream = iter(remote.train)
        for _ in range(2):  # two epochs of one stream: the same 12 images each, once
            assert collections.Counter(_epoch_images(stream, 3)) == expected


def test_each_pass_through_the_service_is_reshuffled(shaded_folder):
    # one worker: its order is the pipeline's seeded one; a job per epoch would repeat it every epoch
    kwargs = dict(augment="none", val_fraction=0.0, test_fraction=0.0, seed=3)
    with start_local_service(workers=1) as one:
        stream = iter(build_image_datasets(f"folder:{shaded_folder}", 8, 4, data_service=one.target, **kwargs).train)
        first, second = _epoch_images(stream, 3), _epoch_images(stream, 3)
    assert sorted(first) == sorted(second) and first != second
