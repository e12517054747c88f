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

JAX_ENV = {"KERAS_BACKEND": "jax", "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "HF_HUB_OFFLINE": "1"}

_TINY_GEMMA = """
import io, numpy as np, keras, keras_hub, sentencepiece as spm

def save_tiny_gemma(path, sequence_length):
    # 4 query and 4 key/value heads: the layout map shards the heads over the model axis (M = 4)
    keras.utils.set_random_seed(0)
    words = ["red", "blue", "green", "cat", "dog", "sun", "moon", "User", "Assistant", "System", "Be", "brief"]
    corpus = [" ".join(np.random.default_rng(i).choice(words, 6)) + " ?:." for i in range(200)]
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_writer=proto, vocab_size=64, model_type="bpe", num_threads=1,
        pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>",
        unk_piece="<unk>", minloglevel=2)
    tok = keras_hub.models.GemmaTokenizer(proto=proto.getvalue())
    pre = keras_hub.models.GemmaCausalLMPreprocessor(tok, sequence_length=sequence_length)
    backbone = keras_hub.models.GemmaBackbone(vocabulary_size=tok.vocabulary_size(), num_layers=1, num_query_heads=4,
                                              num_key_value_heads=4, hidden_dim=16, intermediate_dim=32, head_dim=8)
    keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=pre).save_to_preset(str(path))
    return str(path)
"""

_SCRIPT = _TINY_GEMMA + """
import json, sys, tempfile, time, jax
t0 = time.time()
from trainwell import runtime
from trainwell.models.lora import enable_lora

root = tempfile.mkdtemp()
preset = save_tiny_gemma(root + "/preset", 16)
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
start = {}

def steps(strategy, lora):
    with strategy.scope():
        model = keras_hub.models.CausalLM.from_preset(preset, preprocessor=None)
        if lora:
            enable_lora(model.backbone, 2)
        key = "lora" if lora else "full"
        start.setdefault(key, [np.asarray(w) for w in model.get_weights()])
        model.set_weights(start[key])
        model.compile(keras.optimizers.SGD(0.5), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        losses = [float(model.train_on_batch(x, y, return_dict=True)["loss"]) for _ in range(2)]
    return model, losses

report = {}
for lora in (False, True):
    model, loss_mp = steps(mp, lora)
    _, loss_one = steps(one, lora)
    sharded = {v.path: (v.value.nbytes, sum(s.data.nbytes for s in v.value.addressable_shards
                                             if s.device == jax.devices()[0]),
                        str(v.value.sharding.spec))
               for v in model.backbone.weights if any(a is not None for a in v.value.sharding.spec)}
    report["lora" if lora else "full"] = {"mp": loss_mp, "one": loss_one, "sharded": sharded}
out["runs"] = report
try:
    runtime.use_backbone_layout(runtime.make_strategy("model_parallel:1x8"), keras_hub.models.BertBackbone)
except ValueError as e:
    out["no_layout"] = str(e)
try:
    runtime.make_strategy("model_parallel:3x3")
except ValueError as e:
    out["bad_mesh"] = str(e)
out["seconds"] = time.time() - t0
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def jax_run():
    pytest.importorskip("jax", reason="JAX is not installed (pip install 'trainwell[jax]')")
    r = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=240,
                       env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **JAX_ENV})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_model_parallel_shards_the_kernels_and_trains_as_one_device(jax_run):
    assert jax_run["devices"] == 8 and jax_run["replicas"] == 2  # the batch axis of a 2x4 mesh
    assert "has no layout yet" in jax_run["unbound"]
    full = jax_run["runs"]["full"]
    # Gemma's layout map shards every kernel over the model axis (4) and another dimension over the batch axis (2)
    kernels = {p: v for p, v in full["sharded"].items() if p.endswith(("kernel", "embeddings"))}
    assert len(kernels) == 8, kernels  # embeddings, query, key, value, attention_output, 2 gatings, linear
    for path, (total, on_device_0, spec) in kernels.items():
        assert "model" in spec, (path, spec)
        assert on_device_0 <= total / 4 and on_device_0 == total / 8, (path, total, on_device_0, spec)
    for run in jax_run["runs"].values():  # same start, same batch: the same losses, step 1 and (after SGD) step 2
        assert run["mp"] == pytest.approx(run["one"], rel=1e-5, abs=1e-6)
        assert run["mp"][1] != run["mp"][0]


def test_lora_adapters_follow_their_kernels_layout(jax_run):
    sharded = jax_run["runs"]["lora"]["sharded"]
    # enable_lora's default targets on Gemma: query and value. A: the kernel's input axes; B: its output axis
    for name in ("query", "value"):
        kernel = sharded[f"decoder_block_0/attention/{name}/kernel"][2]
        a = sharded[f"decoder_block_0/attention/{name}/lora_kernel_a"][2]
        assert kernel == "P('model', 'batch', None)" and a == kernel, (kernel, a)
        assert f"decoder_block_0/attention/{name}/lora_kernel_b" not in sharded  # kernel's last axis is whole


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
