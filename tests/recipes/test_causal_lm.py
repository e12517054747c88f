import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing here may reach a model hub

from trainwell.callbacks.checkpoint import latest_checkpoint
from trainwell.callbacks.checkpoint.files import read_checkpoint
from trainwell.config import ConfigError
from trainwell.data.base import DataError
from trainwell.recipes import causal_lm as recipe

SEQ = 24
WORDS = ["red", "blue", "green", "cat", "dog", "sun", "moon"]
G = "\u0120"  # byte-level BPE's space


def _merges(words):
    """Left-to-right merges that make each of `words` one token."""
    out = []
    for w in words:
        for i in range(1, len(w)):
            m = f"{w[:i]} {w[i]}"
            if m not in out:
                out.append(m)
    return out


def save_tiny_gpt2_preset(path, sequence_length=SEQ):
    """A randomly initialised 1-layer GPT-2 (hidden 16) with a byte-level BPE over printable ASCII and a few merges."""
    import keras
    import keras_hub

    keras.utils.set_random_seed(0)
    chars = [chr(c) for c in range(33, 127)] + ["\u0120", "\u010a"]  # byte-level: space is Ġ, newline Ċ
    merges = _merges(["System", "User", "Assistant", "\u010a", *WORDS, *(G + w for w in WORDS + ["Be", "brief"])])
    vocab = {"<|endoftext|>": 0}
    for token in chars + [m.replace(" ", "") for m in merges]:
        vocab.setdefault(token, len(vocab))
    tok = keras_hub.models.GPT2Tokenizer(vocabulary=vocab, merges=merges)
    pre = keras_hub.models.GPT2CausalLMPreprocessor(tok, sequence_length=sequence_length)
    backbone = keras_hub.models.GPT2Backbone(vocabulary_size=len(vocab), num_layers=1, num_heads=2, hidden_dim=16,
                                             intermediate_dim=32, max_sequence_length=64)
    keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=pre).save_to_preset(str(path))
    return str(path)


def make_rows(n, seed=0):
    """`"Colour of X?"` -> the colour: a mapping a tiny model learns; every third row a chat."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        thing, colour = str(rng.choice(WORDS[3:])), str(rng.choice(WORDS[:3]))
        if i % 3 == 2:
            rows.append({"messages": [{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": f"{thing}?"},
                                      {"role": "assistant", "content": colour}]})
        else:
            rows.append({"prompt": f"{thing}?", "response": f" {colour}"})
    return rows


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("clm")
    return {"preset": save_tiny_gpt2_preset(root / "preset"),
            "data": write_jsonl(root / "train.jsonl", make_rows(40)), "root": root}


def tiny_kw(tiny, **kw):
    base = dict(preset=tiny["preset"], dataset=f"jsonl:{tiny['data']}", sequence_length=SEQ, batch_size=8,
                epochs=1, peak_lr=1e-2, verbose="0", doctor=False, num_samples=2, val_fraction=0.2)
    return {**base, **kw}


# --------------------------------------------------------------------------- config and data
@pytest.mark.parametrize("bad, pattern", [
    ({"packing": True}, "would attend to each other.*Received: packing=True"),
    ({"lora": "maybe"}, "Received: lora='maybe'"),
    ({"chat_template": "llama"}, "Received: chat_template='llama'"),
    ({"lora_rank": 0}, "Received: lora_rank=0"),
    ({"sequence_length": 2}, "Received: sequence_length=2"),
    ({"val_fraction": 0.0}, "Received: val_fraction=0.0"),
    ({"dataset": "csv:x.csv"}, "expected 'jsonl:PATH'.*Received: dataset='csv:x.csv'"),
])
def test_config_validation(bad, pattern):
    with pytest.raises(ConfigError, match=pattern):
        recipe.Config(**{"validate_data": False, **bad})


def test_the_preset_and_its_longest_sequence_are_checked_with_the_config(tiny):
    # each was a keras-hub traceback after the run directory was made (the length one inside the first step)
    with pytest.raises(ConfigError, match=r"is not a keras-hub causal LM preset.*Did you mean 'gpt2_base_en'"):
        recipe.Config(preset="gpt2_bse_en", validate_data=False)
    with pytest.raises(ConfigError, match=r"preset directory .*nodir' not found"):
        recipe.Config(preset="./nodir", validate_data=False)
    with pytest.raises(ConfigError, match=r"an integer <= 64: the preset's backbone takes at most 64 positions"):
        recipe.Config(**tiny_kw(tiny, sequence_length=65, validate_data=False))
    recipe.Config(**tiny_kw(tiny, sequence_length=64, validate_data=False))


@pytest.mark.parametrize("line, pattern", [
    ({"prompt": "a"}, "expected the fields \"prompt\" and \"response\".*Received: fields \\['prompt'\\]"),
    ({"prompt": "a", "response": "  "}, "field `response`: expected a non-empty string. Received: response='  '"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "expected one of 'system', 'user', 'assistant'. Received: role='bot'"),
    ({"messages": [{"role": "user", "content": "x"}]}, "at least one assistant turn.*Received: messages=\\['user'\\]"),
    ([1, 2], "is not a JSON object. Received:"),
])
def test_bad_lines_are_one_line_data_errors(tmp_path, line, pattern):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "ok", "response": "fine"}, line])
    with pytest.raises(DataError, match=pattern) as e:
        recipe.Config(dataset=f"jsonl:{path}")
    assert "line 2" in str(e.value) and "\n" not in str(e.value)
    (tmp_path / "n.jsonl").write_text('{"prompt": "a", "response": "b"}\nnot json\n')
    with pytest.raises(DataError, match="line 2 is not JSON.*Received: 'not json'"):
        recipe.Config(dataset=f"jsonl:{tmp_path / 'n.jsonl'}")


def test_response_mask_prompt_tokens_weigh_zero_and_chat_trains_every_assistant_turn(tiny):
    cfg = recipe.Config(**tiny_kw(tiny))
    pre = recipe.build_preprocessor(cfg)
    tok = pre.tokenizer
    chat = {"messages": [{"role": "user", "content": "cat?"}, {"role": "assistant", "content": "red"},
                         {"role": "user", "content": "dog?"}, {"role": "assistant", "content": "blue"}]}
    from trainwell.data import instructions

    examples = [instructions.parse_example(r, "m", 1) for r in ({"prompt": "cat?", "response": " red"}, chat)]
    ids, w, n = recipe.tokenize(cfg, pre, examples)
    assert ids.shape == w.shape == (2, SEQ + 1)
    p, r = np.asarray(tok("cat?")).tolist(), np.asarray(tok(" red")).tolist()
    end = tok.end_token_id
    assert ids[0, : n[0]].tolist() == [tok.start_token_id, *p, *r, end]
    assert w[0].tolist() == [0.0] * (1 + len(p)) + [1.0] * (len(r) + 1) + [0.0] * (SEQ + 1 - n[0])
    # the chat: both assistant turns (content and newline) and the end token weigh 1, nothing else
    weighted = tok.detokenize([int(t) for t, x in zip(ids[1], w[1]) if x == 1.0])
    assert weighted.replace("<|endoftext|>", "") == "red\nblue\n"
    assert instructions.prompt_and_reference(examples[1]) == ("User: cat?\nAssistant: red\nUser: dog?\nAssistant: ",
                                                              "blue\n")


def test_too_long_refused_without_truncation_and_cut_from_the_prompt_with_it(tiny, tmp_path):
    from trainwell.data import instructions

    cfg = recipe.Config(**tiny_kw(tiny))
    pre = recipe.build_preprocessor(cfg)
    long = instructions.parse_example({"prompt": "x" * 40 + "?", "response": " red"}, "m", 1)
    with pytest.raises(DataError, match=f"at most sequence_length \\+ 1 = {SEQ + 1} tokens.*Received: tokens=4"):
        recipe.tokenize(cfg, pre, [long], "long.jsonl")
    ids, w, n = recipe.tokenize(cfg.replace(truncate=True), pre, [long])
    assert n[0] == SEQ + 1 and ids[0, 0] == pre.tokenizer.start_token_id
    assert pre.tokenizer.detokenize(ids[0, -5:].tolist()).endswith("? red<|endoftext|>")  # prompt cut on the left
    assert w[0].sum() == len(np.asarray(pre.tokenizer(" red"))) + 1


@pytest.mark.parametrize("family", ["gpt2", "gemma"])
def test_prompt_targets_contribute_exactly_zero_to_the_loss(tiny, family, tmp_path, tiny_gemma):
    import keras

    preset = tiny["preset"] if family == "gpt2" else tiny_gemma(tmp_path / "gemma", SEQ)
    cfg = recipe.Config(**tiny_kw(tiny, preset=preset))
    pre = recipe.build_preprocessor(cfg)
    data = recipe.build_data(cfg, pre)
    model = recipe.build_model(cfg)
    recipe.compile_model(cfg, model, data.steps_per_epoch)
    x, y, sw = next(iter(data.train))
    x, y, sw = {k: v.numpy() for k, v in x.items()}, y.numpy(), sw.numpy()
    assert ((sw == 0) | x["padding_mask"]).all() and (sw.sum(axis=1) > 0).all()
    logits = model.predict_on_batch(x)
    per_token = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True).numpy()
    expected = (per_token * sw).sum() / sw.sum()
    loss = float(model.loss(y, logits, sample_weight=sw))
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    # other targets at the prompt (and padding) positions: the same loss, to the bit
    y2 = np.where(sw == 0, (y + 7) % model.backbone.vocabulary_size, y)
    assert (y2 != y).any() and float(model.loss(y2, logits, sample_weight=sw)) == loss
    assert ((per_token * sw)[sw == 0] == 0).all()
    if family == "gemma":  # its own start, end and padding tokens; generation runs on it too
        tok = pre.tokenizer
        assert (x["token_ids"][:, 0] == tok.start_token_id).all() and tok.start_token_id != tok.end_token_id
        assert ((y == tok.end_token_id) <= (sw == 1)).all() and (y[~x["padding_mask"]] == tok.pad_token_id).all()
        model.preprocessor = pre
        out = recipe.write_samples(model, data.held_out[:1], tmp_path / "s.jsonl", SEQ)
        (sample,) = [json.loads(line) for line in out.read_text().splitlines()]
        assert sample["prompt"] == recipe.instructions.prompt_and_reference(data.held_out[0])[0]


# --------------------------------------------------------------------------- runs
def test_lora_by_default_above_the_stated_size_only(tiny):
    small = recipe.build_model(recipe.Config(**tiny_kw(tiny)))
    assert not any("lora" in v.path for v in small.weights)  # far below LORA_AUTO_PARAMS: full fine-tuning
    assert recipe.LORA_AUTO_PARAMS == 500_000_000

    class Big:
        def count_params(self):
            return recipe.LORA_AUTO_PARAMS + 1

    assert recipe.uses_lora(recipe.Config(**tiny_kw(tiny)), Big())
    assert not recipe.uses_lora(recipe.Config(**tiny_kw(tiny, lora="off")), Big())
    on = recipe.build_model(recipe.Config(**tiny_kw(tiny, lora="on", lora_rank=2)))
    trainable = {v.path for v in on.trainable_variables}
    assert len([p for p in trainable if "lora_" in p]) == 2 * 2  # A and B on query and value of 1 layer
    assert all("lora_" in p or p.endswith("bias") for p in trainable)  # base weights frozen


def test_lora_run_evaluates_perplexity_writes_samples_and_exports_merged(tiny, tmp_path):
    import keras_hub

    run = recipe.train(**tiny_kw(tiny, run_dir=str(tmp_path / "run"), epochs=2, lora="on", lora_rank=2,
                                 num_samples=1))
    m = run.metrics
    assert set(m) == {"eval_loss", "eval_perplexity", "eval_tokens"}
    assert math.isclose(m["eval_perplexity"], math.exp(m["eval_loss"]), rel_tol=1e-6)
    assert run.history["loss"][-1] < run.history["loss"][0] and "val_perplexity" in run.history
    # eval_loss is the mean over every held-out response token (numpy, from the model's logits)
    cfg = recipe.Config(**tiny_kw(tiny))
    _, held = recipe.split_examples(cfg)
    pre = run.model.preprocessor
    ids, w, n = recipe.tokenize(cfg, pre, held)
    x = {"token_ids": ids[:, :-1], "padding_mask": np.arange(SEQ)[None, :] < (n[:, None] - 1)}
    run.model.preprocessor = None
    logits = run.model.predict_on_batch(x).astype(np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, ids[:, 1:, None], -1)[..., 0]
    assert m["eval_tokens"] == int(w[:, 1:].sum())
    np.testing.assert_allclose(m["eval_loss"], (nll * w[:, 1:]).sum() / w[:, 1:].sum(), rtol=1e-4)
    (sample,) = [json.loads(line) for line in (run.run_dir / "samples.jsonl").read_text().splitlines()]
    assert set(sample) == {"prompt", "reference", "generated"}
    assert (sample["prompt"], sample["reference"]) == recipe.instructions.prompt_and_reference(held[0])
    # trained adapters; the export has none and computes what the adapted model computes
    assert max(float(np.abs(v.numpy()).max()) for v in run.model.weights if "lora_kernel_b" in v.path) > 0
    exported = keras_hub.models.CausalLM.from_preset(str(run.run_dir / "model"))
    assert not any("lora" in v.path for v in exported.weights) and exported.preprocessor is not None
    np.testing.assert_allclose(exported.backbone(x), run.model.backbone(x), rtol=1e-4, atol=1e-5)
    # the checkpoints hold what trains, the frozen base only as fingerprints
    meta, arrays = read_checkpoint(latest_checkpoint(run.run_dir / "checkpoints"))
    assert meta["frozen"] and not set(meta["frozen"]) & set(arrays)
    assert 0 < len([k for k in arrays if k.startswith("model:")]) < len(meta["frozen"])


def _cli(*args, timeout=120):
    trainwell = str(Path(sys.executable).with_name("trainwell"))
    return subprocess.run([trainwell, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "HF_HUB_OFFLINE": "1"})


def test_cli_bad_data_exits_2_in_one_line_and_leaves_no_run_directory(tiny, tmp_path):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a", "response": "b"}, {"messages": [
        {"role": "robot", "content": "x"}]}])
    r = _cli("train", "causal-lm", "--set", f"dataset=jsonl:{bad}", "--set", f"preset={tiny['preset']}",
             "--set", f"sequence_length={SEQ}", "--set", f"run_dir={tmp_path / 'run'}")  # the preset takes 64
    assert r.returncode == 2, r.stderr[-2000:]
    (line,) = r.stderr.strip().splitlines()
    assert "Received: role='robot'" in line and not (tmp_path / "run").exists()


def test_too_long_example_in_a_run_leaves_no_run_directory(tiny, tmp_path):
    long = write_jsonl(tmp_path / "long.jsonl", make_rows(10) + [{"prompt": "x" * 60, "response": "red"}])
    with pytest.raises(DataError, match="Received: tokens="):
        recipe.train(**tiny_kw(tiny, dataset=f"jsonl:{long}", run_dir=str(tmp_path / "runs" / "r")))
    assert not (tmp_path / "runs").exists()


def _subprocess(code: str, timeout=300):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "HF_HUB_OFFLINE": "1"})


@pytest.mark.slow
def test_resume_after_sigkill_matches_uninterrupted_run(tiny, tmp_path, train_code):
    kw = tiny_kw(tiny, epochs=2, checkpoint_every="2", deterministic=True, export=False, num_samples=0,
                 lora="on", lora_rank=2)
    spe = recipe.build_data(recipe.Config(**kw), recipe.build_preprocessor(recipe.Config(**kw))).steps_per_epoch
    ref = _subprocess(train_code("causal_lm", {**kw, "run_dir": str(tmp_path / "ref")}, tmp_path / "ref.npz"))
    assert ref.returncode == 0, ref.stderr[-3000:]
    crash_kw = {**kw, "run_dir": str(tmp_path / "crash")}
    crashed = _subprocess(train_code("causal_lm", crash_kw, tmp_path / "crash.npz", kill_at=spe + 3))
    assert crashed.returncode == -9, crashed.stderr[-3000:]
    index = json.loads((tmp_path / "crash" / "checkpoints" / "checkpoint.json").read_text())["checkpoints"]
    assert spe < max(int(c["global_step"]) for c in index) < spe + 3  # a mid-epoch-2 checkpoint
    resumed = _subprocess(train_code("causal_lm", crash_kw, tmp_path / "crash.npz"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "HISTORY 2" in resumed.stdout
    a, b = np.load(tmp_path / "ref.npz"), np.load(tmp_path / "crash.npz")
    assert len(a.files) == len(b.files) and any("lora" in v.path for v in recipe.build_model(
        recipe.Config(**kw)).weights)
    for k in a.files:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.slow
def test_nan_rollback_and_the_doctor_through_the_recipe(tiny, tmp_path):
    import keras

    class Poison(keras.callbacks.Callback):  # a NaN in the weights after step 3, once
        done = False

        def on_train_batch_end(self, batch, logs=None):
            if batch == 2 and not Poison.done:
                Poison.done = True
                v = self.model.trainable_variables[0]
                v.assign(v * float("nan"))

    kw = {**tiny_kw(tiny, run_dir=str(tmp_path / "run"), epochs=2, snapshot_every=1, num_samples=0, export=False,
                    doctor=True)}
    del kw["peak_lr"]  # the default: 2e-5 without LoRA, written into the run's config (a divergence hint divides it)
    run = recipe.train(callbacks=[Poison()], **kw)
    assert run.config.peak_lr == 2e-5 and recipe.Config(**kw).peak_lr is None
    assert Poison.done and run.history["nan_rollbacks"][-1] >= 1
    assert all(np.isfinite(v.numpy()).all() for v in run.model.weights) and np.isfinite(run.metrics["eval_loss"])
    assert json.loads((run.run_dir / "diagnostics.json").read_text())  # the doctor ran through the recipe


def test_cli_dry_run_of_the_config_file(tiny):
    root = Path(__file__).resolve().parents[2]
    r = _cli("train", "causal-lm", "--config", str(root / "configs" / "gpt2_causal_lm.yaml"),
             "--set", f"dataset=jsonl:{tiny['data']}", "--dry-run")
    assert r.returncode == 0, r.stderr
    resolved = json.loads(r.stdout)
    assert (resolved["preset"], resolved["sequence_length"], resolved["lora"], resolved["packing"]) == (
        "gpt2_base_en", 512, "auto", False)


def test_hypermodel_space_and_build(tiny):
    import keras_tuner as kt

    hm = recipe.hypermodel(recipe.Config(**tiny_kw(tiny, lora="on", lora_rank=2)))
    hp = kt.HyperParameters()
    hm.declare_hyperparameters(hp)
    assert hp.values["lora_rank"] == 2 and hp.values["peak_lr"] == 1e-2
    assert (hm.objective.name, hm.objective.direction) == ("val_token_loss", "min")
    model = hm.build(hp)
    assert any("lora_" in v.path for v in model.trainable_variables)
    off = kt.HyperParameters()
    recipe._tuning_space(off, recipe.Config(**tiny_kw(tiny, lora="off")))
    assert "lora_rank" not in off.values


@pytest.mark.serial
def test_model_parallel_over_two_worker_processes_shards_checkpoints_samples_and_exports(tmp_path, tiny_gemma):
    # trainwell train --workers 2 keeps strategy=model_parallel:2x4 (its mesh over both processes' devices),
    # trains both epochs of a finite dataset (Keras's split over processes lost its length: the second
    # epoch found it exhausted), writes each process's shards, and gathers the weights for the
    # samples and the merged export.
    pytest.importorskip("orbax.checkpoint", reason="orbax-checkpoint is not installed (pip install 'trainwell[jax]')")
    preset = tiny_gemma(tmp_path / "gemma", 16, num_query_heads=4, num_key_value_heads=4)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"cat{i % 3}?", "response": " red"}) + "\n" for i in range(40)))
    run_dir = tmp_path / "run"
    sets = [f"preset={preset}", f"dataset=jsonl:{data}", "sequence_length=16", "batch_size=8", "epochs=2",
            "strategy=model_parallel:2x4", f"run_dir={run_dir}", "num_samples=2", "val_fraction=0.25",
            "checkpoint_every=2", "lora=on", "verbose=0"]
    env = {**os.environ, "KERAS_BACKEND": "jax", "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
           "TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "trainwell.cli", "train", "causal-lm", "--workers", "2",
                        *[a for s in sets for a in ("--set", s)]], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    assert "strategy: model_parallel:2x4" in (run_dir / "config.yaml").read_text()
    assert len((run_dir / "history.csv").read_text().splitlines()) == 3  # a header and both epochs
    last = Path(latest_checkpoint(run_dir / "checkpoints"))
    assert sorted(p.name for p in (last / "sharded").glob("ocdbt.process_*")) == ["ocdbt.process_0",
                                                                                  "ocdbt.process_1"]
    assert len((run_dir / "samples.jsonl").read_text().splitlines()) == 2
    assert (run_dir / "model" / "config.json").is_file() and (run_dir / "model" / "model.weights.h5").is_file()
