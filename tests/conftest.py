import os
import subprocess
import sys
import textwrap

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def run_python(code: str, timeout: float = 240, env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter (needed for `cpu:N`, which must precede any TF op)."""
    full_env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd,
    )


@pytest.fixture
def python_subprocess():
    return run_python


def recipe_train_code(module: str, kw: dict, out, kill_at: int = 0) -> str:
    """A script that trains `trainwell.recipes.<module>` with `kw`, saves the weights to `out` and prints
    `HISTORY <epochs>`; with `kill_at`, it SIGKILLs itself after that many training batches (after the
    recipe's own callbacks: its Checkpoint has run). The recipes' crash-and-compare tests run it."""
    return (
        "import os, signal, keras, numpy as np\n"
        f"from trainwell.recipes import {module} as r\n"
        f"KILL_AT = {kill_at}\n"
        "class Kill(keras.callbacks.Callback):  # after the recipe's own callbacks (its Checkpoint)\n"
        "    seen = 0\n"
        "    def on_train_batch_end(self, batch, logs=None):\n"
        "        Kill.seen += 1\n"
        "        if Kill.seen == KILL_AT:\n"
        "            os.kill(os.getpid(), signal.SIGKILL)\n"
        f"run = r.train(callbacks=[Kill()] if KILL_AT else None, **{kw!r})\n"
        f"np.savez({str(out)!r}, *run.model.get_weights())\n"
        "print('HISTORY', len(run.history['loss']))\n"
    )


@pytest.fixture
def train_code():
    """`recipe_train_code`, for tests (conftest helpers reach tests as fixtures)."""
    return recipe_train_code


def save_tiny_gemma_preset(path, sequence_length: int, num_query_heads: int = 2, num_key_value_heads: int = 1) -> str:
    """A randomly initialised 1-layer Gemma causal LM (hidden 16) with a 64-piece SentencePiece BPE trained
    here, saved as a keras-hub preset directory (backend-neutral: a JAX subprocess loads it too)."""
    import io

    import keras
    import keras_hub
    import numpy as np
    import sentencepiece as spm

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
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=tok.vocabulary_size(), num_layers=1, num_query_heads=num_query_heads,
        num_key_value_heads=num_key_value_heads, hidden_dim=16, intermediate_dim=32, head_dim=8)
    keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=pre).save_to_preset(str(path))
    return str(path)


@pytest.fixture(scope="session")
def tiny_gemma():
    """`save_tiny_gemma_preset`, for tests."""
    return save_tiny_gemma_preset


def write_photo_folder(root, count: int, sides: tuple[int, int], name: str = "{i}.jpg"):
    """`count` random JPEGs of `sides[0]`-`sides[1]` px a side (seeded) in `root/c0` and `root/c1`, alternating."""
    import numpy as np  # here: conftest is imported by every test, most without NumPy or TensorFlow
    import tensorflow as tf

    rng = np.random.default_rng(0)
    for i in range(count):
        (root / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        shape = (int(rng.integers(sides[0], sides[1] + 1)), int(rng.integers(sides[0], sides[1] + 1)), 3)
        image = rng.integers(0, 256, shape, dtype=np.uint8)
        (root / f"c{i % 2}" / name.format(i=i)).write_bytes(tf.io.encode_jpeg(image).numpy())
    return root


@pytest.fixture(scope="session")
def photo_folder():
    """`write_photo_folder`: a class folder of random JPEGs."""
    return write_photo_folder


@pytest.fixture
def tf_cache_clears(monkeypatch) -> list:
    """A list that gets one entry per clear of TensorFlow's kernel caches (what `tf.random.set_seed` does)."""
    from tensorflow.python import pywrap_tfe  # the private name `trainwell.compat.tf_internals` keeps out

    calls, clear = [], pywrap_tfe.TFE_ContextClearCaches

    def counting(handle):
        calls.append(handle)
        return clear(handle)

    monkeypatch.setattr(pywrap_tfe, "TFE_ContextClearCaches", counting)
    return calls


def _save_tiny_bert_preset(path, words, sequence_length: int):
    """Saves a randomly initialised 2-layer BERT text classifier (hidden 16) over `words` as a preset.

    Deterministic: the weights come from `keras.utils.set_random_seed(0)`.
    """
    import keras
    import keras_hub

    keras.utils.set_random_seed(0)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + list(words)
    tok = keras_hub.models.BertTokenizer(vocabulary=vocab, lowercase=True)
    pre = keras_hub.models.BertTextClassifierPreprocessor(tok, sequence_length=sequence_length)
    backbone = keras_hub.models.BertBackbone(vocabulary_size=len(vocab), num_layers=2, num_heads=2, hidden_dim=16,
                                             intermediate_dim=32, max_sequence_length=sequence_length)
    keras_hub.models.BertTextClassifier(backbone, num_classes=2, preprocessor=pre).save_to_preset(str(path))
    return str(path)


@pytest.fixture(scope="session")
def tiny_bert_preset():
    """`tiny_bert_preset(path, words, sequence_length)`: a tiny random BERT preset for fast recipe tests."""
    return _save_tiny_bert_preset


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Runs the tests marked `slow` first (the order is kept otherwise).

    `make test` spreads the tests over pytest-xdist workers: started first, the longest
    jobs (the notebooks, the recipe runs in subprocesses) do not leave one worker running
    alone at the end while the others idle. That needs `--maxschedchunk 1` (the Makefile):
    by default xdist hands each worker a contiguous quarter of its share at the start, so the
    first worker got every slow test.
    """
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


_CPU_LOG = os.environ.get("TRAINWELL_TEST_CPU_LOG")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With `TRAINWELL_TEST_CPU_LOG=FILE`, appends one JSON line per test: wall and CPU seconds.

    CPU time counts this process and the subprocesses it waited for (setup, call and teardown
    together): on the shared 2-core machine it is a steadier measure of a test's cost than
    `--durations`' wall time, which moves 2-20x with what runs beside it (bench/README.md,
    "Test suite timings").
    """
    if not _CPU_LOG:
        yield
        return
    import json
    import resource
    import time

    def cpu():
        s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return s.ru_utime + s.ru_stime, c.ru_utime + c.ru_stime

    t0, (s0, c0) = time.monotonic(), cpu()
    yield
    t1, (s1, c1) = time.monotonic(), cpu()
    with open(_CPU_LOG, "a") as f:
        f.write(json.dumps({"test": item.nodeid, "wall": round(t1 - t0, 2), "cpu_self": round(s1 - s0, 2),
                            "cpu_children": round(c1 - c0, 2),
                            "worker": os.environ.get("PYTEST_XDIST_WORKER", "")}) + "\n")


@pytest.fixture(scope="session")
def _s3_server():
    """moto's standalone S3 server on 127.0.0.1 at a free port, for the session; torn down after."""
    import socket

    from moto.server import ThreadedMotoServer  # a test dependency (`moto[server]`): only tests that use S3 need it

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def s3_bucket(_s3_server, monkeypatch):
    """A fresh, empty bucket on the local S3 server: `s3://<name>`. The endpoint and (dummy) credentials are
    set through the standard variables (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY), as a
    user's MinIO or Ceph would be."""
    import uuid

    import boto3  # comes with moto: only tests that use S3 need it

    env = {"AWS_ENDPOINT_URL": _s3_server, "AWS_ACCESS_KEY_ID": "testing-key-id",
           "AWS_SECRET_ACCESS_KEY": "testing-secret-value", "AWS_DEFAULT_REGION": "us-east-1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    name = f"tw-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=_s3_server, region_name="us-east-1").create_bucket(Bucket=name)
    return f"s3://{name}"
