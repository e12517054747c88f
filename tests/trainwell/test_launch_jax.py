"""`trainwell.launch` on Keras's JAX backend: two local processes joined by `jax.distributed`."""

from __future__ import annotations

import inspect
import json
import sys
import textwrap

import numpy as np
import pytest

from trainwell import launch

pytest.importorskip("jax", reason="JAX is not installed (pip install 'trainwell[jax]'); the JAX backend is not tested")


def _eval_case():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(11, 3)).astype("float32")
    return x, (x[:, 0] > 0).astype("int32"), rng.normal(size=(3, 2)).astype("float32")


_WORKER = inspect.getsource(_eval_case) + """
import json, os, sys
from trainwell import runtime
out = sys.argv[1]
s = runtime.make_strategy("multiworker")  # keras.distribution.initialize() from the launcher's variables
pid = int(os.environ["KERAS_DISTRIBUTION_PROCESS_ID"])
# Each process raises a different flag: the OR must reach both, through the strategy and through
# `None` (what callbacks pass on JAX, where a model has no distribute_strategy).
got = runtime.any_across_workers(s, [pid == 1, False, pid == 0])
got_none = runtime.any_across_workers(None, [False, pid == 1])
chosen = runtime.broadcast_from_chief(s, [20261201235959 + pid, -pid])  # e.g. the run directory's stamp
if runtime.is_chief(None):
    open(os.path.join(out, f"chief-{pid}"), "w").write("written by the chief only")
# Evaluation splits with a short last batch (global batch 4): 10 = 4 + 4 + 2 examples (unpadded, one process
# gets a batch more than the other and waits for ever) and 11 = 4 + 4 + 3 (a batch of 2 on one process and 1
# on the other: wrong metrics). Each must end with every example scored once.
import keras, numpy as np, tensorflow as tf
x, y, kernel = _eval_case()
with s.scope():
    m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, use_bias=False)])
    m.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True), weighted_metrics=["accuracy"])
    m.set_weights([kernel])
with runtime.fit_scope(s):
    ev = [m.evaluate(tf.data.Dataset.from_tensor_slices((x[:n], y[:n])).batch(4), verbose=0, return_dict=True)
          for n in (10, 11)]
port = int(os.environ["KERAS_DISTRIBUTION_JOB_ADDRESSES"].split(",")[0].rsplit(":", 1)[1])
listen = sorted({line.split()[1].split(":")[0] for name in ("tcp", "tcp6") for line in open(f"/proc/net/{name}")
                 if line.split()[3] == "0A" and line.split()[1].endswith(f":{port:04X}")})
with open(os.path.join(out, f"process-{pid}.json"), "w") as f:
    json.dump({"flags": got, "flags_none": got_none, "chosen": chosen, "listen": listen, "chief": runtime.is_chief(s),
               "workers": [runtime.num_workers(s), runtime.num_workers(None)],
               "replicas": runtime.num_replicas(s), "evaluate": ev}, f)
runtime.sync_workers(s)  # neither leaves before the other got here
"""


@pytest.mark.serial
def test_two_jax_processes_agree_and_only_the_chief_writes(tmp_path):
    # The launcher starts two JAX processes (jax.distributed on loopback); they agree on flags and
    # on the chief's values, only process 0 writes, and an evaluation with a short last batch ends (a
    # hang fails by the launcher's timeout) with one process's metrics.
    env = {"KERAS_BACKEND": "jax", "XLA_FLAGS": "", "OMP_NUM_THREADS": "1"}
    code = launch.launch([sys.executable, "-c", textwrap.dedent(_WORKER), str(tmp_path)], workers=2, env=env,
                         timeout_s=150, log_dir=tmp_path / "logs", stream_chief=False, peer_grace_s=5)
    logs = "\n".join(p.read_text(errors="replace")[-1500:] for p in sorted((tmp_path / "logs").glob("*.log")))
    assert code == 0, logs
    results = [json.loads((tmp_path / f"process-{i}.json").read_text()) for i in range(2)]
    for i, r in enumerate(results):
        assert r["flags"] == [True, False, True] and r["flags_none"] == [False, True], (i, r)
        assert r["chosen"] == [20261201235959, 0], (i, r)  # the chief's, beyond 32 bits
        assert r["workers"] == [2, 2] and r["replicas"] == 2 and r["chief"] == (i == 0), (i, r)
    assert sorted(p.name for p in tmp_path.glob("chief-*")) == ["chief-0"]
    # The short last batches: both processes report what one process scoring each example once reports.
    x, y, kernel = _eval_case()
    logits = x @ kernel
    log_p = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    for j, n in enumerate((10, 11)):
        want = {"loss": -log_p[np.arange(n), y[:n]].mean(), "accuracy": (logits[:n].argmax(axis=1) == y[:n]).mean()}
        for i, r in enumerate(results):
            got = r["evaluate"][j]
            assert got.keys() == want.keys() and all(np.isclose(got[k], v, rtol=1e-5) for k, v in want.items()), (
                n, i, got, want)
    # JAX's coordinator listens on 127.0.0.1 only (IPv4, or IPv4-mapped in tcp6), not on every interface ([::])
    assert results[0]["listen"] and all(a.endswith("0100007F") for a in results[0]["listen"]), results[0]
