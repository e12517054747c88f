"""The recipes on TensorFlow and on JAX, side by side in one run: steps/s and test accuracy.

Each backend runs in a fresh subprocess (`KERAS_BACKEND` is read once, at Keras's
import); rounds alternate between the backends so that the machine's load falls on
both alike. Each round trains, with the same seed:

- `resnet`: the ResNet recipe's `train()` on the embedded `digits` (its demo-sized
  configuration below), callbacks included;
- `finetune`: the transformer recipe's `train()` on the embedded MiniLM and
  `rotten_tomatoes`, capped to `--finetune-examples` training examples.

steps/s counts the training steps after each run's first epoch (the first holds the
compilation: XLA on JAX, tf.function tracing on TensorFlow), timed between the ends of
batches. Test accuracy is the recipe's own `run.metrics["test_accuracy"]`; the same seed
draws different dropout masks and initial weights on each backend, so the accuracies
agree within noise, not exactly. Prints one JSON object.

Run:
    python bench/backends.py                 # 3 rounds
    python bench/backends.py --smoke         # one short round of each (about 5 min on 2 CPU cores)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

_CHILD = r"""
import json, sys, time
import keras
from trainwell.recipes import resnet_imagenet, transformer_finetune

kind, kw = sys.argv[1], json.loads(sys.argv[2])

class Timer(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.epoch, self.steps, self.t0 = 0, 0, None
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
    def on_train_batch_end(self, batch, logs=None):
        if self.epoch == 0:
            self.t0 = time.perf_counter()  # the end of the last batch of the first epoch
        else:
            self.steps += 1
            self.t1 = time.perf_counter()

timer = Timer()
recipe = resnet_imagenet if kind == "resnet" else transformer_finetune
run = recipe.train(callbacks=[timer], **kw)
sps = timer.steps / (timer.t1 - timer.t0) if timer.steps else None
print("RESULT " + json.dumps({"backend": keras.backend.backend(), "steps_per_s": sps, "timed_steps": timer.steps,
                              "test_accuracy": run.metrics.get("test_accuracy")}))
"""


def configs(args) -> dict:
    resnet = dict(dataset="digits", image_size=16, model="resnet18", width=8, batch_size=64, epochs=args.epochs,
                  augment="none", verbose=0, doctor=False, seed=0)
    finetune = dict(preset="minilm", dataset="rotten_tomatoes", max_train_examples=args.finetune_examples,
                    sequence_length=64, batch_size=16, epochs=args.epochs, verbose="0", doctor=False, export=False,
                    early_stopping_patience=None, seed=0)
    return {"resnet": resnet, "finetune": finetune}


def run_child(backend: str, kind: str, kw: dict, timeout: int) -> dict:
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3", HF_HUB_OFFLINE="1")
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _CHILD, kind, json.dumps(kw)], capture_output=True, text=True,
                          env=env, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    out = json.loads(lines[-1][len("RESULT "):])
    out["wall_s"] = round(time.perf_counter() - t, 1)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--finetune-examples", type=int, default=1024)
    p.add_argument("--backends", default="tensorflow,jax")
    p.add_argument("--kinds", default="resnet,finetune")
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--smoke", action="store_true", help="one round, 2 epochs, 128 fine-tune examples")
    args = p.parse_args(argv)
    if args.smoke:
        args.rounds, args.epochs, args.finetune_examples = 1, 2, 128
    backends, kinds = args.backends.split(","), args.kinds.split(",")
    cfgs = configs(args)
    rounds: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = backends if r % 2 == 0 else backends[::-1]  # alternate who goes first
            for kind in kinds:
                for backend in order:
                    kw = {**cfgs[kind], "run_dir": os.path.join(tmp, f"{kind}-{backend}-{r}")}
                    res = run_child(backend, kind, kw, args.timeout)
                    rounds.append({"round": r, "kind": kind, **res, "backend": backend})
                    print(json.dumps(rounds[-1]), file=sys.stderr, flush=True)
    summary = {}
    for kind in kinds:
        for backend in backends:
            rs = [x for x in rounds if x["kind"] == kind and x["backend"] == backend and "error" not in x]
            sps = sorted(x["steps_per_s"] for x in rs if x.get("steps_per_s"))
            acc = [x["test_accuracy"] for x in rs if x.get("test_accuracy") is not None]
            summary[f"{kind}/{backend}"] = {
                "steps_per_s_median": sps[len(sps) // 2] if sps else None,
                "test_accuracy_mean": sum(acc) / len(acc) if acc else None,
                "runs": len(rs),
            }
    print(json.dumps({"configs": cfgs, "rounds": rounds, "summary": summary}, indent=1))
    return 0 if all("error" not in x for x in rounds) else 1


if __name__ == "__main__":
    sys.exit(main())
