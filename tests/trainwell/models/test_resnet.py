import keras
import numpy as np
import pytest

from trainwell.models import RESNET_DEPTHS, build_resnet, build_resnet_from_name


def _trainable(model):
    return sum(int(np.prod(w.shape)) for w in model.trainable_weights)


def test_resnet50_has_exactly_torchvision_parameter_count():
    model = build_resnet(50, num_classes=1000, input_shape=(224, 224, 3))
    assert _trainable(model) == 25_557_032
    assert model.output_shape == (None, 1000)
    assert model.name == "resnet50"


def test_resnet18_parameter_count_and_v15_strides():
    assert _trainable(build_resnet(18, 1000, (224, 224, 3))) == 11_689_512
    model = build_resnet(50, 10, (64, 64, 3))
    # v1.5: the stride-2 of a downsampling bottleneck sits on the 3x3, not on the first 1x1.
    assert model.get_layer("stage2_block1_1_conv").strides == (1, 1)
    assert model.get_layer("stage2_block1_2_conv").strides == (2, 2)
    assert model.get_layer("stage2_block1_0_conv").strides == (2, 2)  # projection shortcut
    assert all(not layer.use_bias for layer in model.layers if isinstance(layer, keras.layers.Conv2D))
    bn = model.get_layer("stem_bn")
    assert np.isclose(bn.momentum, 0.9) and np.isclose(bn.epsilon, 1e-5)


def test_output_float32_under_mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = build_resnet(18, 10, (32, 32, 3), small_stem=True)
        assert model.get_layer("stem_conv").compute_dtype == "float16"
        assert model.get_layer("logits").compute_dtype == "float32"
        assert model.get_layer("predictions").compute_dtype == "float32"
        y = model(np.zeros((2, 32, 32, 3), np.float32), training=False)
        assert keras.backend.standardize_dtype(y.dtype) == "float32"
        assert keras.backend.standardize_dtype(model.output.dtype) == "float32"
        assert np.allclose(keras.ops.convert_to_numpy(y).sum(axis=1), 1.0, atol=1e-5)
    finally:
        keras.mixed_precision.set_global_policy("float32")


@pytest.mark.parametrize("depth,last", [(18, "2"), (50, "3")])
def test_zero_gamma_on_last_bn_of_each_residual_branch(depth, last):
    model = build_resnet(depth, 10, (32, 32, 3), small_stem=True)
    n_blocks = sum(RESNET_DEPTHS[depth][1])
    zero = [ly for ly in model.layers if ly.name.endswith(f"_{last}_bn")]
    assert len(zero) == n_blocks
    assert all(np.allclose(ly.gamma.numpy(), 0.0) for ly in zero)
    others = [ly for ly in model.layers if isinstance(ly, keras.layers.BatchNormalization) and ly not in zero]
    assert others and all(np.allclose(ly.gamma.numpy(), 1.0) for ly in others)
    # Each identity block therefore starts as relu(identity) of its input.
    keras.utils.set_random_seed(0)
    x = np.random.default_rng(0).normal(size=(2, 32, 32, 3)).astype("float32")
    probe = keras.Model(model.input, [model.get_layer("stage1_block1_out").output,
                                      model.get_layer("stage1_block2_out").output])
    a, b = (keras.ops.convert_to_numpy(t) for t in probe(x, training=False))
    assert np.allclose(a, b, atol=1e-6) and a.std() > 0
    off = build_resnet(depth, 10, (32, 32, 3), small_stem=True, zero_init_residual=False)
    assert np.allclose(off.get_layer(f"stage1_block1_{last}_bn").gamma.numpy(), 1.0)


def test_he_normal_fan_out_init():
    keras.utils.set_random_seed(0)
    model = build_resnet(18, 10, (64, 64, 3))
    k = model.get_layer("stage4_block1_2_conv").kernel.numpy()  # 3x3x512x512
    fan_out = 3 * 3 * 512
    assert np.isclose(k.std(), np.sqrt(2.0 / fan_out), rtol=0.02)
    assert np.isclose(model.get_layer("logits").kernel.numpy().std(), 0.01, rtol=0.05)


def test_small_stem_output_shapes():
    small = build_resnet(18, 10, (32, 32, 3), small_stem=True)
    assert small.get_layer("stage1_block1_out").output.shape == (None, 32, 32, 64)
    assert small.get_layer("stage4_block2_out").output.shape == (None, 4, 4, 512)
    big = build_resnet(18, 10, (32, 32, 3))
    assert big.get_layer("stage1_block1_out").output.shape == (None, 8, 8, 64)
    assert big.get_layer("stage4_block2_out").output.shape == (None, 1, 1, 512)
    gray = build_resnet(18, 10, (28, 28, 1), small_stem=True)
    assert gray.get_layer("stage4_block2_out").output.shape == (None, 4, 4, 512)  # 28->14->7->4 (symmetric pad)


def test_tiny_fit_resnet18_small_stem():
    keras.utils.set_random_seed(0)
    model = build_resnet(18, 4, (16, 16, 3), small_stem=True, dropout=0.1, weight_decay=1e-4)
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss=keras.losses.CategoricalCrossentropy(label_smoothing=0.1), metrics=["accuracy"],
                  run_eagerly=True)  # two steps: tracing the graph would cost more than it saves
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 16, 16, 3)).astype("float32")
    y = keras.utils.to_categorical(rng.integers(0, 4, size=16), 4)
    before = model.get_layer("logits").kernel.numpy().copy()
    hist = model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert np.isfinite(hist.history["loss"][0])
    # Initial loss ~ ln(4) (near-uniform softmax) + the L2 term.
    assert 1.0 < hist.history["loss"][0] < 3.0
    assert not np.allclose(before, model.get_layer("logits").kernel.numpy())
    assert model.get_layer("dropout").rate == 0.1


def test_weight_decay_l2_has_gradient_wd_times_w():
    model = build_resnet(18, 3, (8, 8, 1), small_stem=True, weight_decay=2e-4)
    kernels = [ly.kernel for ly in model.layers if isinstance(ly, (keras.layers.Conv2D, keras.layers.Dense))]
    assert len(model.losses) == len(kernels) == 21
    want = sum(1e-4 * float(np.sum(np.square(k.numpy()))) for k in kernels)
    got = float(sum(keras.ops.convert_to_numpy(v) for v in model.losses))
    assert np.isclose(got, want, rtol=1e-4)
    assert build_resnet(18, 3, (8, 8, 1), small_stem=True).losses == []


def test_build_from_name_and_invalid_arguments():
    m = build_resnet_from_name("ResNet-34", 5, (32, 32, 3), small_stem=True)
    assert m.name == "resnet34" and m.output_shape == (None, 5)
    with pytest.raises(ValueError, match="Received: model_name='resnet20'"):
        build_resnet_from_name("resnet20", 5, (32, 32, 3))
    with pytest.raises(ValueError, match="Received: depth=20"):
        build_resnet(20, 5, (32, 32, 3))
    with pytest.raises(ValueError, match="Received: num_classes=0"):
        build_resnet(18, 0, (32, 32, 3))
    with pytest.raises(ValueError, match="Received: dropout=1.0"):
        build_resnet(18, 2, (32, 32, 3), dropout=1.0)
    with pytest.raises(ValueError, match="Received: input_shape=\\(32, 32\\)"):
        build_resnet(18, 2, (32, 32))


def test_fused_batchnorm_by_default_on_tensorflow_same_weights_and_checkpoint_names_either_way():
    import keras

    from trainwell.compat.keras_internals import walk_saveables
    from trainwell.models.layers import FusedBatchNormalization

    fused = build_resnet(18, 10, (16, 16, 1), small_stem=True, width=4)
    plain = build_resnet(18, 10, (16, 16, 1), small_stem=True, width=4, fused_batchnorm=False)  # as on JAX
    for model, kernel in ((fused, True), (plain, False)):
        bns = [layer for layer in model.layers if isinstance(layer, keras.layers.BatchNormalization)]
        assert bns and all(type(layer) is FusedBatchNormalization and layer.fused is kernel for layer in bns)
    assert [w.path for w in fused.weights] == [w.path for w in plain.weights]
    # A checkpoint (and Keras's .weights.h5) names a layer by its class: the same on every backend.
    assert [p for p, _ in walk_saveables(fused, set())] == [p for p, _ in walk_saveables(plain, set())]
    plain.set_weights(fused.get_weights())  # weight files interchange


def test_fused_batchnorm_must_be_a_bool():
    with pytest.raises(ValueError, match="Received: fused_batchnorm='yes'"):
        build_resnet(18, 10, (16, 16, 1), fused_batchnorm="yes")


def test_a_checkpoint_with_the_old_keras_batchnorm_names_loads_into_the_resnet_layers(tmp_path):
    """Runs written before the ResNet built `FusedBatchNormalization` on every backend (JAX built
    Keras's `BatchNormalization`, whose checkpoint keys are `batch_normalization_N`) still resume."""
    import keras

    from trainwell.callbacks import Checkpoint, load_checkpoint
    from trainwell.models.layers import FusedBatchNormalization

    def net(bn):
        x = inp = keras.Input((6, 6, 1))
        for i in range(2):
            x = bn(momentum=0.9, name=f"b{i}_bn")(keras.layers.Conv2D(3, 3, padding="same", name=f"b{i}_conv")(x))
        out = keras.layers.Dense(2, name="logits")(keras.layers.GlobalAveragePooling2D()(x))
        model = keras.Model(inp, out)
        model.compile(keras.optimizers.SGD(0.1, momentum=0.9), "mse")
        return model

    x = np.random.default_rng(0).normal(size=(8, 6, 6, 1)).astype("float32")
    y = np.ones((8, 2), "float32")
    old = net(keras.layers.BatchNormalization)
    old.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[Checkpoint(str(tmp_path / "ckpt"), save_every=2)])
    new = net(FusedBatchNormalization)
    new.build((None, 6, 6, 1))
    load_checkpoint(tmp_path / "ckpt", new, include_optimizer=True)
    for a, b in zip(old.get_weights(), new.get_weights()):
        np.testing.assert_array_equal(a, b)
    slots = lambda m: sorted(float(np.sum(v)) for v in m.optimizer.variables if "momentum" in v.name)  # noqa: E731
    assert slots(new) == slots(old) and any(slots(old))
