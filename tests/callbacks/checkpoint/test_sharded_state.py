"""Checkpoint of a model whose state no process holds whole (ModelParallel over two JAX processes, Orbax)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from trainwell import launch
from trainwell.callbacks import list_checkpoints, read_checkpoint, resume_checkpoint
from trainwell.callbacks.checkpoint.files import CheckpointCorruptError
from trainwell.compat.sharded import ShardedArray

pytest.importorskip("jax", reason="JAX is not installed (pip install 'trainwell[jax]'); the JAX backend is not tested")
pytest.importorskip("orbax.checkpoint", reason="orbax-checkpoint is not installed (pip install 'trainwell[jax]')")

WORKER = Path(__file__).with_name("sharded_worker.py")


def _run(mode: str, out: Path, processes: int) -> int:
    env = {"KERAS_BACKEND": "jax", "OMP_NUM_THREADS": "1",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={8 // processes}"}
    if processes == 1:
        return subprocess.run([sys.executable, str(WORKER), mode, str(out)], env={**os.environ, **env},
                              timeout=150, capture_output=True).returncode
    return launch.launch([sys.executable, str(WORKER), mode, str(out)], workers=processes, env=env, timeout_s=150,
                         log_dir=out / f"logs-{mode}", stream_chief=False, peer_grace_s=5)


def _logs(out: Path) -> str:
    return "\n".join(p.read_text(errors="replace")[-1500:] for p in sorted(out.glob("logs-*/*.log")))


@pytest.mark.serial
def test_sharded_state_resumes_exactly_across_two_processes_and_loads_on_another_mesh(tmp_path):
    assert _run("full", tmp_path, 2) == 0, _logs(tmp_path)
    # Killed while committing the checkpoint of step 6, after both processes wrote their shards.
    assert _run("crash", tmp_path, 2) != 0
    ckpt = tmp_path / "ckpt"
    assert [e["name"] for e in list_checkpoints(ckpt)] == ["ckpt-3"]
    assert any(p.name.startswith(".tmp-ckpt-") for p in ckpt.iterdir())  # the uncommitted shards
    meta, arrays = read_checkpoint(ckpt / "ckpt-3")
    sharded = sorted(k for k, a in arrays.items() if isinstance(a, ShardedArray))
    # The three sharded kernels and bias, and Adam's two slots of each, went through Orbax; the
    # replicated bias, seeds and counters stayed in arrays.npz.
    assert len(sharded) == 9 and all(k.startswith(("model:", "opt:")) for k in sharded), sharded
    assert not any(k.endswith("layers/d2/1") for k in sharded) and sorted(meta["sharded"]) == sharded
    # Every process wrote only its own shards.
    written = sorted(p.name for p in (ckpt / "ckpt-3" / "sharded").glob("ocdbt.process_*"))
    assert written == ["ocdbt.process_0", "ocdbt.process_1"]
    with pytest.raises(ValueError, match="sharded across processes"):
        np.asarray(arrays[sharded[0]])

    assert _run("resume", tmp_path, 2) == 0, _logs(tmp_path)
    full, resumed = np.load(tmp_path / "full.npz"), np.load(tmp_path / "resume.npz")
    assert sorted(full.files) == sorted(resumed.files)
    for k in full.files:  # bit-identical to the run never killed: weights, Adam's slots, its step
        np.testing.assert_array_equal(resumed[k], full[k], err_msg=k)
    seen = [json.loads((tmp_path / f"resume-{i}.json").read_text()) for i in range(2)]
    assert all(s["batches"] == 5 for s in seen), seen  # resumed at step 3 of 8: not trained from the start
    assert all(len(s["local_only"]) == 3 and s["sharded_keys"] == sharded for s in seen), seen
    assert not any(p.name.startswith(".tmp-ckpt-") for p in ckpt.iterdir())  # removed when the resume started
    assert [e["name"] for e in list_checkpoints(ckpt)][-1] == "ckpt-8"

    # One process with eight devices on a 2 x 4 mesh reads the same checkpoint into its sharding.
    assert _run("load", tmp_path, 1) == 0
    loaded = np.load(tmp_path / "load.npz")
    for k in full.files:
        np.testing.assert_allclose(loaded[k], full[k], rtol=0, atol=0, err_msg=k)

    # A checkpoint whose shards Orbax never committed is damaged: a resume skips it for the one before.
    shutil.rmtree(ckpt / "ckpt-8" / "sharded" / "ocdbt.process_1")
    with pytest.raises(CheckpointCorruptError, match="sharded arrays"):
        read_checkpoint(ckpt / "ckpt-8")
    assert resume_checkpoint(ckpt)["name"] == "ckpt-6"
