import csv
import json

import numpy as np
import pytest

from trainwell.data import text

POS = ["good", "great", "fun", "superb"]
NEG = ["bad", "awful", "dull", "boring"]
FILL = ["the", "film", "was", "a", "and", "story", "really", "very", "it"]


def make_texts(n, seed=0, names=("neg", "pos")):
    rng = np.random.default_rng(seed)
    texts, labels = [], []
    for _ in range(n):
        y = int(rng.integers(2))
        words = list(rng.choice(FILL, size=int(rng.integers(1, 25))))
        words.insert(int(rng.integers(len(words) + 1)), str(rng.choice(POS if y else NEG)))
        texts.append(" ".join(words))
        labels.append(names[y])
    return texts, labels


def write_csv(path, rows, fields=("text", "label")):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(fields)
        w.writerows(rows)
    return path


@pytest.fixture(scope="module")
def preprocessor():
    import keras_hub

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + POS + NEG + FILL
    tok = keras_hub.models.BertTokenizer(vocabulary=vocab, lowercase=True)
    return keras_hub.models.BertTextClassifierPreprocessor(tok, sequence_length=32)


def test_python_lists_string_labels_are_mapped_and_carved():
    texts, labels = make_texts(200)
    s = text.load_text_splits((texts, labels), val_fraction=0.1, test_fraction=0.2, seed=3)
    assert s.class_names == ["neg", "pos"] and s.label_to_id == {"neg": 0, "pos": 1}
    assert s.sizes() == {"train": 140, "val": 20, "test": 40}
    everything = np.concatenate([s.train[0], s.val[0], s.test[0]])
    assert sorted(everything.tolist()) == sorted(texts)  # disjoint and complete
    # ids follow the mapping
    lookup = dict(zip(texts, labels))
    assert all(s.class_names[y] == lookup[t] for t, y in zip(s.train[0], s.train[1]))
    again = text.load_text_splits((texts, labels), val_fraction=0.1, test_fraction=0.2, seed=3)
    assert np.array_equal(again.train[0], s.train[0])  # deterministic


def test_python_dict_with_given_splits_and_int_labels():
    data = {"train": (["a", "b", "c", "d"], [0, 1, 2, 1]), "validation": (["e"], [2]), "test": (["f", "g"], [0, 1])}
    s = text.load_text_splits(data)
    assert s.class_names == ["0", "1", "2"] and s.sizes() == {"train": 4, "val": 1, "test": 2}
    assert s.val[1].tolist() == [2] and s.train[1].dtype == np.int64
    with pytest.raises(ValueError, match="3 texts but 2 labels"):
        text.load_text_splits((["a", "b", "c"], [0, 1]))


def test_csv_file_and_directory(tmp_path):
    texts, labels = make_texts(100)
    f = write_csv(tmp_path / "reviews.csv", zip(texts, labels))
    s = text.load_text_splits(f"csv:{f}", val_fraction=0.2, test_fraction=0.1)
    assert s.class_names == ["neg", "pos"] and s.sizes() == {"train": 70, "val": 20, "test": 10}
    d = tmp_path / "dir"
    d.mkdir()
    write_csv(d / "train.csv", zip(texts[:60], labels[:60]))
    write_csv(d / "dev.csv", zip(texts[60:80], labels[60:80]))
    write_csv(d / "test.csv", zip(texts[80:], labels[80:]))
    s = text.load_text_splits(f"csv:{d}")
    assert s.sizes() == {"train": 60, "val": 20, "test": 20}
    assert s.test[0].tolist() == texts[80:]


def test_jsonl_with_custom_fields(tmp_path):
    texts, labels = make_texts(50)
    p = tmp_path / "r.jsonl"
    p.write_text("\n".join(json.dumps({"review": t, "sentiment": y, "id": i}) for i, (t, y) in
                           enumerate(zip(texts, labels))) + "\n\n")
    s = text.load_text_splits(f"jsonl:{p}", label_field="sentiment", val_fraction=0.2, test_fraction=0.0)
    assert s.sizes() == {"train": 40, "val": 10, "test": 0} and s.test is None
    assert s.class_names == ["neg", "pos"]
    s2 = text.load_text_splits(f"jsonl:{p}", text_field="review", label_field="sentiment")
    assert set(s2.train[0]) <= set(texts)


def test_clear_errors_name_the_field_or_file(tmp_path):
    good = write_csv(tmp_path / "good.csv", [("nice", "pos"), ("meh", "neg")])
    with pytest.raises(ValueError, match=r"Text field 'body' not found in '.*good\.csv'"):
        text.load_text_splits(f"csv:{good}", text_field="body")
    with pytest.raises(ValueError, match=r"Label field 'stars' not found in '.*good\.csv'"):
        text.load_text_splits(f"csv:{good}", label_field="stars")
    nolabel = write_csv(tmp_path / "nt.csv", [("x", "y")], fields=("comment", "label"))
    with pytest.raises(ValueError, match=r"No text field in '.*nt\.csv'"):
        text.load_text_splits(f"csv:{nolabel}")
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    with pytest.raises(ValueError, match=r"Empty file: '.*empty\.csv'"):
        text.load_text_splits(f"csv:{empty}")
    header_only = tmp_path / "header.csv"
    header_only.write_text("text,label\n")
    with pytest.raises(ValueError, match=r"Empty file: '.*header\.csv'"):
        text.load_text_splits(f"csv:{header_only}")
    empty_jsonl = tmp_path / "e.jsonl"
    empty_jsonl.write_text("\n\n")
    with pytest.raises(ValueError, match=r"Empty file: '.*e\.jsonl'"):
        text.load_text_splits(f"jsonl:{empty_jsonl}")
    with pytest.raises(FileNotFoundError, match="missing.csv"):
        text.load_text_splits(f"csv:{tmp_path / 'missing.csv'}")
    d = tmp_path / "unseen"
    d.mkdir()
    write_csv(d / "train.csv", [("a", "pos"), ("b", "neg")] * 5)
    write_csv(d / "test.csv", [("c", "pos"), ("d", "meh")])
    with pytest.raises(ValueError, match=r"Label 'meh' in '.*unseen/test\.csv' never occurs in the training data"):
        text.load_text_splits(f"csv:{d}")
    with pytest.raises(ValueError, match=r"Invalid value for argument `source`.*Received: source='parquet:x'"):
        text.load_text_splits("parquet:x")


def test_tfds_sources_with_mock_data():
    import tensorflow_datasets as tfds

    with tfds.testing.mock_data(num_examples=30):
        sst2 = text.load_text_splits("tfds:glue/sst2", val_fraction=0.2)
        # GLUE's test split has no labels: validation is the test split, val is carved from train.
        assert sst2.class_names == ["negative", "positive"]
        assert sst2.sizes() == {"train": 24, "val": 6, "test": 30}
        assert isinstance(sst2.train[0][0], str)
        imdb = text.load_text_splits("tfds:imdb_reviews", val_fraction=0.1)
        assert imdb.class_names == ["neg", "pos"] and imdb.sizes()["test"] == 30
        with pytest.raises(ValueError, match="Label field 'stars' not found in TFDS dataset 'imdb_reviews'"):
            text.load_text_splits("tfds:imdb_reviews", label_field="stars")


def test_rotten_tomatoes_and_truncation():
    s = text.load_text_splits("rotten_tomatoes", max_train_examples=100)
    assert s.class_names == ["rotten", "fresh"]
    assert s.sizes() == {"train": 100, "val": 1280, "test": 2562}


def test_label_map_round_trip(tmp_path):
    path = text.save_label_map(tmp_path, ["rotten", "fresh"])
    assert path.name == "labels.json"
    assert json.loads(path.read_text())["label_to_id"] == {"rotten": 0, "fresh": 1}
    assert text.load_label_map(tmp_path) == ["rotten", "fresh"]
    with pytest.raises(FileNotFoundError, match="labels.json"):
        text.load_label_map(tmp_path / "nowhere")


@pytest.mark.slow
def test_pipeline_tokenises_buckets_and_reshuffles(preprocessor):
    texts, labels = make_texts(300, seed=1)
    s = text.load_text_splits((texts, labels), val_fraction=0.1, test_fraction=0.1)
    data = text.build_text_datasets(s, preprocessor, 16, sequence_length=32, seed=5)
    assert text.bucket_boundaries(32) == [16, 24, 32]
    n_train = len(s.train[1])
    lengths = [len(t.split()) + 2 for t in s.train[0]]  # one token per word here, + [CLS] [SEP]
    buckets = np.searchsorted([16, 24, 32], np.minimum(lengths, 32))
    assert data.steps_per_epoch == sum(c // 16 for c in np.bincount(buckets))
    assert data.train.cardinality().numpy() == data.steps_per_epoch

    def epoch(ds):
        out = []
        for x, y in ds:
            ids = x["token_ids"].numpy()
            width = ids.shape[1]
            assert width in (16, 24, 32) and ids.shape[0] == 16
            true_len = x["padding_mask"].numpy().sum(axis=1)
            assert true_len.max() <= width and (width == 16 or true_len.max() > {24: 16, 32: 24}[width])
            out.append(ids[:, :4].tolist())
        return out

    e1, e2 = epoch(data.train), epoch(data.train)
    assert len(e1) == data.steps_per_epoch and e1 != e2  # a new order each epoch
    again = text.build_text_datasets(s, preprocessor, 16, sequence_length=32, seed=5)
    assert epoch(again.train) == e1  # the same order for the same seed in a fresh pipeline
    assert sum(len(b) for b in e1) > n_train - 3 * 16  # at most one partial batch per bucket dropped
    # evaluation keeps the order and covers every example once
    got = np.concatenate([y.numpy() for _, y in data.test])
    assert np.array_equal(got, s.test[1]) and data.steps["test"] == 1


def test_integer_labels_are_the_distinct_values_sorted_not_a_range():
    s = text.load_text_splits((["a", "b", "c", "d"], [7, 0, 7, 0]), val_fraction=0.0, test_fraction=0.0)
    assert s.class_names == ["0", "7"] and s.train[1].tolist() == [1, 0, 1, 0]  # 2 classes, not 8
    big = text.load_text_splits((["a", "b"] * 2, [0, 300_000_000] * 2), val_fraction=0.0, test_fraction=0.0)
    assert big.class_names == ["0", "300000000"]  # no range(300000001) of names
    num = text.load_text_splits((["a", "b", "c"] * 2, ["10", "2", "-1"] * 2), val_fraction=0.0, test_fraction=0.0)
    assert num.class_names == ["-1", "2", "10"]  # numeric order, negatives allowed
    with pytest.raises(text.DataError, match=r"Label 5 in the 'test' data never occurs in the training data"):
        text.load_text_splits({"train": (["a", "b"], [0, 7]), "test": (["c"], [5])})


@pytest.mark.parametrize(
    "content, match",
    [
        ('{"text": "a", "label": [0]}\n{"text": "b", "label": [1]}\n',
         r"The label in row 1 of '.*x\.jsonl' is not a single value: \[0\]\. Expected one string or number"),
        ('{"text": "a", "label": {"y": 1}}\n{"text": "b", "label": 0}\n', r"is not a single value: \{'y': 1\}"),
        ('{"text": ["a"], "label": 0}\n{"text": "b", "label": 1}\n', r"Text #0 of '.*x\.jsonl' is not a string"),
        ('{"text": "a", "label": 0}\n{"text": "b", "label": 1\n', r"Invalid JSON on line 2 of '.*x\.jsonl'"),
        ('{"text": "a", "label": "pos"}\n{"text": "b", "label": "pos"}\n',
         r"The training data \('.*x\.jsonl'\) has only one class \('pos', 2 examples\): a classifier needs at least 2"),
    ],
    ids=["list label", "dict label", "list text", "bad line", "one class"],
)
def test_bad_jsonl_is_a_one_line_data_error(tmp_path, content, match):
    p = tmp_path / "x.jsonl"
    p.write_text(content)
    with pytest.raises(text.DataError, match=match) as e:
        text.load_text_splits(f"jsonl:{p}", val_fraction=0.0, test_fraction=0.0)
    assert "\n" not in str(e.value)


def test_file_encoding_and_long_fields(tmp_path):
    latin = tmp_path / "latin.csv"
    latin.write_bytes("text,label\nfine,pos\ncaf\xe9 cr\xe8me,neg\n".encode("latin-1"))
    with pytest.raises(text.DataError, match=r"'.*latin\.csv' is not UTF-8 text \(byte 0xe9 on line 3\); save it as"):
        text.load_text_splits(f"csv:{latin}")
    long_text = "word " * 40_000  # 200 KB: over Python csv's default field limit of 128 KiB
    big = write_csv(tmp_path / "big.csv", [(long_text, "pos"), ("short", "neg")] * 3)
    s = text.load_text_splits(f"csv:{big}", val_fraction=0.0, test_fraction=0.0)
    assert max(len(t) for t in s.train[0]) == len(long_text)
    assert csv.field_size_limit() == 131072  # the process-wide limit is left as it was
    bom = tmp_path / "bom.csv"
    bom.write_bytes("\ufefftext,label\na,pos\nb,neg\n".encode("utf-8"))  # Excel's UTF-8 CSV
    assert text.load_text_splits(f"csv:{bom}", val_fraction=0.0, test_fraction=0.0).sizes()["train"] == 2


def test_checking_a_config_and_loading_read_the_file_once(tmp_path, monkeypatch):
    from trainwell.data.sources import check_text_source

    texts, labels = make_texts(40)
    f = write_csv(tmp_path / "r.csv", zip(texts, labels))
    reads = []
    real = text._read_table
    monkeypatch.setattr(text, "_read_table", lambda *a: reads.append(a[0]) or real(*a))
    check_text_source(f"csv:{f}")
    s = text.load_text_splits(f"csv:{f}")
    assert len(reads) == 1 and s.sizes()["train"] == 28
    f.write_text("text,label\n" + "".join(f"t{i},{i % 2}\n" for i in range(10)))  # a new file is read again
    assert text.load_text_splits(f"csv:{f}", val_fraction=0.0, test_fraction=0.0).class_names == ["0", "1"]
    assert len(reads) == 2
