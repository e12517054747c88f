"""`strategy="model_parallel:DxM"` on Keras's JAX backend (trainwell.compat.jax_distribution).

The JAX half runs in one fresh interpreter with `KERAS_BACKEND=jax` and 8 virtual CPU
devices (`XLA_FLAGS`); the pytest process runs on TensorFlow and checks the specs and
the TensorFlow refusal.
"""

import json
import os
import subprocess
import sys

import pytest

from trainwell import runtime

# XLA's quick, unoptimised CPU compiles (as tests/recipes/test_recipes_jax.py): what runs, not what it computes
JAX_ENV = {"KERAS_BACKEND": "jax", "HF_HUB_OFFLINE": "1",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 "
                        "--xla_llvm_disable_expensive_passes=true"}


_CORE = """
import json, sys, tempfile, jax
import numpy as np, keras, keras_hub
from trainwell import runtime
from trainwell.models.lora import enable_lora

preset = sys.argv[1]  # saved by the test (tests/conftest.py save_tiny_gemma_preset)
mp = runtime.make_strategy("model_parallel:2x4")
one = runtime.make_strategy("one_device")
out = {"devices": len(jax.devices()), "replicas": mp.num_replicas_in_sync}
try:
    with mp.scope():
        pass
except RuntimeError as e:
    out["unbound"] = str(e)
runtime.use_backbone_layout(mp, keras_hub.models.GemmaBackbone)
rng = np.random.default_rng(0)
x = {"token_ids": rng.integers(4, 64, (8, 16)).astype("int32"), "padding_mask": np.ones((8, 16), "bool")}
y = rng.integers(4, 64, (8, 16)).astype("int32")
start = []

def steps(strategy):
    with strategy.scope():
        model = keras_hub.models.CausalLM.from_preset(preset, preprocessor=None)
        enable_lora(model.backbone, 2)
        if not start:  # random B (Keras starts it at 0): the adapters change the first step's loss
            start.extend(np.asarray(w) if "lora_kernel_b" not in w.path else rng.normal(0, 0.5, w.shape)
                         for w in model.weights)
        model.set_weights(start)
        model.compile(keras.optimizers.SGD(0.5), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        losses = [float(model.train_on_batch(x, y, return_dict=True)["loss"]) for _ in range(2)]
    return model, losses

model, out["mp"] = steps(mp)
out["one"] = steps(one)[1]
dev0 = jax.devices()[0]
out["sharded"] = {v.path: (v.value.nbytes, sum(s.data.nbytes for s in v.value.addressable_shards if s.device == dev0),
                           str(v.value.sharding.spec))
                  for v in model.backbone.weights if any(a is not None for a in v.value.sharding.spec)}
try:
    runtime.use_backbone_layout(runtime.make_strategy("model_parallel:1x8"), keras_hub.models.BertBackbone)
except ValueError as e:
    out["no_layout"] = str(e)
try:
    runtime.make_strategy("model_parallel:3x3")
except ValueError as e:
    out["bad_mesh"] = str(e)
print(json.dumps(out))
"""

_RECIPE = """
import json, sys, tempfile
from trainwell.recipes import causal_lm

root = tempfile.mkdtemp()
preset = sys.argv[1]
with open(root + "/train.jsonl", "w") as f:
    for i in range(20):
        f.write(json.dumps({"prompt": f"cat{i % 3}?", "response": " red"}) + "\\n")
run = causal_lm.train(preset=preset, dataset="jsonl:" + root + "/train.jsonl", sequence_length=16, batch_size=8,
                      epochs=1, max_steps=1, strategy="model_parallel:2x4", precision="mixed_bfloat16",
                      run_dir=root + "/run", verbose="0", doctor=False, num_samples=0, export=False, val_fraction=0.25)
block = run.model.backbone.get_layer("decoder_block_0")
print(json.dumps({"eval_loss": run.metrics["eval_loss"], "spec": str(block.attention.query_dense.kernel.value.sharding.spec),
                  "compute_dtype": block.compute_dtype}))
"""


def _run_jax(script: str, preset: str) -> dict:
    pytest.importorskip("jax", reason="JAX is not installed (pip install 'trainwell[jax]')")
    r = subprocess.run([sys.executable, "-c", script, preset], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **JAX_ENV})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _gemma(tiny_gemma, root) -> str:
    # 4 query and 4 key/value heads: the layout map shards the heads over the model axis (M = 4)
    return tiny_gemma(root / "preset", 16, num_query_heads=4, num_key_value_heads=4)


@pytest.fixture(scope="module")
def jax_run(tmp_path_factory, tiny_gemma):
    return _run_jax(_CORE, _gemma(tiny_gemma, tmp_path_factory.mktemp("mp")))


def test_model_parallel_shards_the_kernels_and_trains_as_one_device(jax_run):
    assert jax_run["devices"] == 8 and jax_run["replicas"] == 2  # the batch axis of a 2x4 mesh
    assert "has no layout yet" in jax_run["unbound"]
    # Gemma's layout map shards every kernel over the model axis (4) and another dimension over the batch axis (2)
    kernels = {p: v for p, v in jax_run["sharded"].items() if p.endswith(("/kernel", "embeddings"))}
    assert len(kernels) == 8, kernels  # embeddings, query, key, value, attention_output, 2 gatings, linear
    for path, (total, on_device_0, spec) in kernels.items():
        assert "model" in spec, (path, spec)
        assert on_device_0 <= total / 4 and on_device_0 == total / 8, (path, total, on_device_0, spec)
    # same start (random LoRA B), same batch: the same losses at step 1 and, after an SGD step, step 2
    assert jax_run["mp"] == pytest.approx(jax_run["one"], rel=1e-5, abs=1e-6)
    assert abs(jax_run["mp"][1] - jax_run["mp"][0]) > 1e-3


def test_lora_adapters_follow_their_kernels_layout(jax_run):
    sharded = jax_run["sharded"]
    # enable_lora's default targets on Gemma: query and value. A: the kernel's input axes; B: its output axis
    for name in ("query", "value"):
        kernel = sharded[f"decoder_block_0/attention/{name}/kernel"][2]
        a = sharded[f"decoder_block_0/attention/{name}/lora_kernel_a"][2]
        assert kernel == "P('model', 'batch', None)" and a == kernel, (kernel, a)
        assert f"decoder_block_0/attention/{name}/lora_kernel_b" not in sharded  # kernel's last axis is whole


@pytest.mark.slow  # ~25 s: the recipe's run directory, fit and evaluation compile; the only test of that path
def test_causal_lm_recipe_runs_model_parallel_in_mixed_bfloat16(tmp_path, tiny_gemma):
    # 5 held-out examples: a batch the mesh's batch axis (2) cannot split unless padded (EvenBatchesModelParallel)
    recipe = _run_jax(_RECIPE, _gemma(tiny_gemma, tmp_path))
    assert recipe["spec"] == "P('model', 'batch', None)" and recipe["compute_dtype"] == "bfloat16", recipe
    assert 0 < recipe["eval_loss"] < 10, recipe


def test_one_line_errors(jax_run):
    assert "GemmaBackbone, LlamaBackbone" in jax_run["no_layout"] and "Received: backbone=BertBackbone" in \
        jax_run["no_layout"] and "\n" not in jax_run["no_layout"]
    assert "needs D * M = 8" in jax_run["bad_mesh"] and "Received: strategy='model_parallel:3x3'" in \
        jax_run["bad_mesh"]


@pytest.mark.parametrize("spec", ["model_parallel:0x8", "model_parallel:2x", "model_parallel"])
def test_bad_spec_is_refused(spec):
    with pytest.raises(ValueError, match=rf"Received: strategy='{spec}'"):
        runtime.validate_strategy_spec(spec)


def test_tensorflow_backend_refuses_model_parallel():
    runtime.validate_strategy_spec("model_parallel:2x4")
    with pytest.raises(ValueError, match="JAX backend only.*Received: strategy='model_parallel:2x4'"):
        runtime.make_strategy("model_parallel:2x4")
