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

    `make test` spreads the tests over 2 pytest-xdist workers: started first, the longest
    jobs (the notebooks, the recipe runs in subprocesses) do not leave one worker running
    alone at the end while the other idles.
    """
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
