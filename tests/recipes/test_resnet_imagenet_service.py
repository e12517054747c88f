"""The ResNet recipe with `data_service`: its training input decoded and augmented on a tf.data service."""

import keras
import pytest

from trainwell.config import ConfigError
from trainwell.data.service import start_local_service
from trainwell.recipes import resnet_imagenet as recipe

TINY = dict(dataset="digits", image_size=8, model="resnet18", width=4, epochs=2, batch_size=128,
            warmup_epochs=0.5, verbose=0, doctor=False, augment="pad_crop", nan_rollback=False)


@pytest.mark.parametrize("bad", ["localhost:5050", "grpc://host", "grpc://host:0", "http://host:5050", ""])
def test_data_service_is_checked_in_one_line(bad):
    with pytest.raises(ConfigError) as e:
        recipe.Config(dataset="digits", data_service=bad)
    assert "data_service" in str(e.value) and "Received:" in str(e.value) and "\n" not in str(e.value)


def test_data_service_with_progressive_resizing_is_refused():
    with pytest.raises(ConfigError, match="image_size_schedule"):
        recipe.Config(dataset="digits", image_size_schedule=[[0, 8], [0.5, 16]], data_service="grpc://h:5050")


def test_a_run_with_two_local_workers_trains_every_step_of_each_epoch(tmp_path):
    class Steps(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.per_epoch = []

        def on_epoch_begin(self, epoch, logs=None):
            self.per_epoch.append(0)

        def on_train_batch_end(self, batch, logs=None):
            self.per_epoch[-1] += 1

    steps = Steps()
    with start_local_service(workers=2) as service:
        run = recipe.train(**TINY, run_dir=str(tmp_path / "run"), data_service=service.target, callbacks=[steps])
    n = recipe.Config(**TINY).train_examples()
    assert steps.per_epoch == [n // 128] * 2  # 1259 examples: 9 full batches each epoch, none short
    assert run.config.data_service == service.target
    assert 0.0 <= run.metrics["test_accuracy"] <= 1.0 and len(run.history["loss"]) == 2


@pytest.mark.slow  # two runs of the recipe: the resume semantics with the service (exact count, not order)
def test_a_mid_epoch_resume_with_the_service_trains_exactly_the_remaining_steps_and_warns(tmp_path):
    steps_per_epoch = recipe.Config(**TINY).train_examples() // 128  # 9

    class Crash(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if int(keras.ops.convert_to_numpy(self.model.optimizer.iterations)) == 6:
                raise RuntimeError("crash in epoch 1")

    class Trained(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.steps = 0

        def on_train_batch_end(self, batch, logs=None):
            self.steps += 1

    trained, run_dir = Trained(), str(tmp_path / "run")
    kw = dict(TINY, run_dir=run_dir, checkpoint_every="4")
    with start_local_service(workers=1) as service:
        with pytest.raises(RuntimeError, match="crash in epoch 1"):
            recipe.train(**kw, data_service=service.target, callbacks=[Crash()])
        with pytest.warns(UserWarning, match="exact, their order is not"):
            run = recipe.train(**kw, data_service=service.target, callbacks=[trained])
    # resumed at step 4: the 5 steps left of epoch 1, then epoch 2; the optimizer counted every step once
    assert trained.steps == 2 * steps_per_epoch - 4
    assert int(keras.ops.convert_to_numpy(run.model.optimizer.iterations)) == 2 * steps_per_epoch
