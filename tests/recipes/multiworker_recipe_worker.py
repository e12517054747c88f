"""One process of a recipe run, used by tests/recipes/test_multiworker.py.

Usage: python multiworker_recipe_worker.py RECIPE OVERRIDES_JSON OUT_PREFIX

Limits TensorFlow to one thread, trains `trainwell.recipes.RECIPE` with the
overrides (under `TF_CONFIG` the strategy is `"multiworker"`; the caller sets
`strategy` otherwise) and writes `OUT_PREFIX-<task>.json` (task, history,
run_dir, replicas, metrics, NaN-rollback events, the paths of the checkpoint
arrays it wrote, the BatchNorm moving statistics' checksums) and
`OUT_PREFIX-<task>.npz` (the final weights). Task is -1 without `TF_CONFIG`.

Test hooks (environment):
- `TEST_NAN_AT_STEP=K` and `TEST_NAN_TASK=I`: worker I reports non-finite
  weights to `NaNRollback` after its K-th step (a local-only detection), once.
- `TEST_NAN_SYNC=0`: `NaNRollback.sync_across_workers = False` on every instance.

The process ends with `os._exit` (gRPC threads can hang interpreter teardown
once a peer is gone); an exception exits 3, `SystemExit(c)` exits c.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ["HF_HUB_OFFLINE"] = "1"


_INSTANCES: list = []


def _install_nan_hook():
    from trainwell.callbacks import nan_rollback

    first_init = nan_rollback.NaNRollback.__init__

    def record(self, *args, **kwargs):
        first_init(self, *args, **kwargs)
        _INSTANCES.append(self)

    nan_rollback.NaNRollback.__init__ = record
    at = int(os.environ.get("TEST_NAN_AT_STEP", "0") or 0)
    sync = os.environ.get("TEST_NAN_SYNC", "1") != "0"
    if not at and sync:
        return
    task = int(os.environ.get("TEST_NAN_TASK", "1"))
    tf_config = os.environ.get("TF_CONFIG")
    me = json.loads(tf_config)["task"]["index"] if tf_config else -1
    orig_init = nan_rollback.NaNRollback.__init__
    orig_probe = nan_rollback.NaNRollback._probe

    def init(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        if not sync:
            self.sync_across_workers = False

    def probe(self, check_weights, *args, **kwargs):
        vals = orig_probe(self, check_weights, *args, **kwargs)
        if at and me == task and self.step == at and not getattr(self, "_test_fired", False):
            self._test_fired = True
            vals = vals.copy()
            vals[2] = 0.0  # "a weight is not finite", seen by this worker only
        return vals

    nan_rollback.NaNRollback.__init__ = init
    nan_rollback.NaNRollback._probe = probe


_WRITES: list = []


def _record_checkpoint_writes():
    from trainwell.callbacks.checkpoint import files

    orig = files.write_npz

    def write_npz(path, arrays):
        _WRITES.append(str(path))
        return orig(path, arrays)

    files.write_npz = write_npz  # the writer calls files.write_npz at each write


def main(recipe_name: str, overrides_json: str, out_prefix: str) -> int:
    tf_config = os.environ.get("TF_CONFIG")
    task = json.loads(tf_config)["task"]["index"] if tf_config else -1
    summary: dict = {"task": task}
    code = 0
    try:
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
        import importlib

        import numpy as np

        _install_nan_hook()
        _record_checkpoint_writes()
        overrides = json.loads(overrides_json)
        if tf_config:
            overrides["strategy"] = "multiworker"
        mod = importlib.import_module(f"trainwell.recipes.{recipe_name}")
        run = mod.train(**overrides)
        model = run.model
        weights = model.get_weights()
        np.savez(f"{out_prefix}-{task}.npz", *weights)
        bn = [w.numpy() for w in model.weights if "moving_" in w.path]
        summary.update(
            history={k: [float(x) for x in v] for k, v in run.history.items()},
            run_dir=str(run.run_dir),
            replicas=int(model.distribute_strategy.num_replicas_in_sync),
            metrics={k: float(v) for k, v in run.metrics.items()},
            bn_moving=[float(np.sum(np.abs(b))) for b in bn],
        )
        summary["nan_events"] = [e for cb in _INSTANCES for e in cb.events]
    except SystemExit as e:
        code = int(e.code or 0)
        summary["exit"] = code
    except BaseException as e:  # reported to the parent, which asserts on it
        summary["error"] = f"{type(e).__name__}: {e}"[:4000]
        summary["traceback"] = traceback.format_exc()[-4000:]
        code = 3
    summary["checkpoint_writes"] = list(_WRITES)
    with open(f"{out_prefix}-{task}.json.tmp", "w") as f:
        json.dump(summary, f)
    os.replace(f"{out_prefix}-{task}.json.tmp", f"{out_prefix}-{task}.json")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
