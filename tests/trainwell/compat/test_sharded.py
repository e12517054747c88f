"""`trainwell.compat.sharded` in one process (the two-process run: tests/callbacks/checkpoint/test_sharded_state.py)."""

from __future__ import annotations

import numpy as np
import pytest

from trainwell.compat.sharded import ShardedArray, complete, placeholders, split_sharded


def test_arrays_one_process_holds_whole_are_not_sharded():
    jnp = pytest.importorskip("jax.numpy")
    arrays = {"a": jnp.ones((2, 3)), "b": np.zeros(2)}
    sharded, rest = split_sharded(arrays)
    assert sharded == {} and rest.keys() == arrays.keys()


def test_a_sharded_directory_is_complete_only_with_orbax_metadata_and_every_writers_shards(tmp_path):
    assert not complete(tmp_path)
    (tmp_path / "_CHECKPOINT_METADATA").write_text("{}")
    for i in (0, 1):
        (tmp_path / "array_metadatas").mkdir(exist_ok=True)
        (tmp_path / "array_metadatas" / f"process_{i}").write_text("{}")
    (tmp_path / "ocdbt.process_0").mkdir()
    (tmp_path / "ocdbt.process_0" / "manifest.ocdbt").write_bytes(b"x")
    assert not complete(tmp_path)  # process 1's shards are missing
    (tmp_path / "ocdbt.process_1").mkdir()
    (tmp_path / "ocdbt.process_1" / "manifest.ocdbt").write_bytes(b"x")
    assert complete(tmp_path)


def test_a_placeholder_has_the_shape_for_the_checks_and_refuses_to_be_read_as_numpy():
    p = placeholders("ckpt-3/sharded", {"model:d/0": {"item": "a0", "shape": [4, 8], "dtype": "bfloat16"}})
    assert isinstance(p["model:d/0"], ShardedArray) and p["model:d/0"].shape == (4, 8)
    with pytest.raises(ValueError, match="sharded across processes.*load_checkpoint"):
        np.asarray(p["model:d/0"])
