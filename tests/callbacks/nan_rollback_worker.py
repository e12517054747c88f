"""Subprocess of test_nan_rollback.py: its NaNRollback checks, on whatever
backend `KERAS_BACKEND` names (the test runs it on JAX), printed as one JSON line.

- `inf`: an inf loss at batches 5 and 30 (their sample weights; NaN weights follow), `NaNRollback(snapshot_every=4)`;
- `spike`: batches 3 and 20 scaled to 30.0 (finite, huge losses), spike detection at its defaults.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, str(Path(__file__).parent))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import test_nan_rollback as t  # noqa: E402  (its model, data and poisoned pipeline)
from trainwell.callbacks.nan_rollback import NaNRollback  # noqa: E402


def run(bad, value, epochs):
    model = t.build()
    cb = NaNRollback(snapshot_every=4)
    calls = []  # compiled calls of the check's own (the per-step check runs in the train step)
    probe_call = cb._probe_call
    cb._probe_call = lambda weights: calls.append(weights) or probe_call(weights)
    hist = t.fit(model, bad=bad, value=value, callbacks=[cb], epochs=epochs)
    keys = ("step", "restored_step", "causes", "iterations_before", "iterations_after", "lr_before", "lr_after")
    return {
        "events": [{k: e[k] for k in keys} for e in cb.events],
        "finite": t.finite(model),
        "accuracy": t.accuracy(model),
        "loss_finite": bool(np.all(np.isfinite(hist.history["loss"]))),
        "lr": t.lr_of(model),
        "probe_calls": len(calls),
        "weight_checks": sum(1 for w in calls if w),
        "history_keys": sorted(hist.history),
    }


def main() -> int:
    out = {"backend": keras.backend.backend()}
    out["inf"] = run([5, 30], np.inf, 4)
    out["spike"] = run([3, 20], 30.0, 4)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
