"""The cost of a recipe's first steps on TensorFlow: Keras's own `fit` against `build_before_fit` + `fit`.

Keras's TensorFlow `fit` without a distribution strategy builds the compiled metrics
(and an unbuilt optimizer) inside the first trace of the train function; their new
variables make `tf.function` trace the whole train step a second time.
`trainwell.compat.build_before_fit` (which both recipes call) builds them first, from
the dataset's element spec: one trace. This bench measures what that saves.

Each case runs in a fresh interpreter per mode, rounds alternating which mode goes
first: the recipe's own data, model and `compile_model` (no callbacks), then a timed
`fit` of 2 steps with validation on 2 batches, preceded in mode "trainwell" by
`build_before_fit` (inside the timed part). It reports the process CPU time and
wall time of that part, and how many times the train step was traced (a
`train_step` call in Python is a trace).

Cases: "resnet18" (the ResNet recipe, ResNet-18 width 16 on `digits` at 32 px) and
"minilm" (the transformer recipe on the embedded MiniLM and `rotten_tomatoes`,
sequence length 32); `--cases resnet50` adds the ImageNet default network at 64 px.

Run:
    python bench/first_step.py                 # 3 rounds, resnet18 and minilm
    python bench/first_step.py --rounds 1 --cases resnet18
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import log, machine_info, print_json, rnd, summary  # noqa: E402

CASES = {
    "resnet18": ("resnet_imagenet", dict(dataset="digits", image_size=32, model="resnet18", width=16,
                                         batch_size=32, precision="float32")),
    "resnet50": ("resnet_imagenet", dict(dataset="digits", image_size=64, model="resnet50", batch_size=32,
                                         precision="float32")),
    "minilm": ("transformer_finetune", dict(preset="minilm", dataset="rotten_tomatoes", sequence_length=32,
                                            batch_size=32, max_train_examples=640, precision="float32",
                                            jit_compile=False)),
}

_CHILD = textwrap.dedent(
    """
    import json, os, sys, time
    os.environ["HF_HUB_OFFLINE"] = "1"
    import keras
    from trainwell.compat import build_before_fit
    from trainwell.recipes import resnet_imagenet, transformer_finetune

    recipe_name, kw, mode = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    recipe = {"resnet_imagenet": resnet_imagenet, "transformer_finetune": transformer_finetune}[recipe_name]
    cfg = recipe.Config(**kw, epochs=1, seed=0, doctor=False)
    if recipe is resnet_imagenet:
        data = recipe.build_data(cfg)
        train, val, steps = data.train, data.val, recipe.training_steps(cfg, data)
        model = recipe.build_model(cfg, data.num_classes, data.channels)
    else:
        pre = recipe.build_preprocessor(cfg)
        data = recipe.build_data(cfg, pre)
        train, val, steps = data.train, data.val, data.steps_per_epoch
        model = recipe.build_model(cfg, data.num_classes)
    recipe.compile_model(cfg, model, steps)
    traces = [0]
    step = model.train_step

    def counted(*a):
        traces[0] += 1
        return step(*a)

    model.train_step = counted
    c0, t0 = time.process_time(), time.perf_counter()
    if mode == "trainwell":
        build_before_fit(model, train)
    model.fit(train, validation_data=val.take(2), epochs=1, steps_per_epoch=2, verbose=0)
    print("RESULT " + json.dumps({"cpu_s": time.process_time() - c0, "wall_s": time.perf_counter() - t0,
                                  "train_traces": traces[0]}))
    """
)


def _run(case: str, mode: str) -> dict:
    recipe, kw = CASES[case]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "KERAS_BACKEND": "tensorflow"}
    p = subprocess.run([sys.executable, "-c", _CHILD, recipe, json.dumps(kw), mode], capture_output=True,
                       text=True, env=env, timeout=1800)
    lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"{case}/{mode} failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cases", default="resnet18,minilm", help=f"comma-separated, of {sorted(CASES)}")
    args = ap.parse_args()
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown or args.rounds < 1:
        ap.error(f"--cases must name some of {sorted(CASES)} and --rounds must be >= 1. Received: "
                 f"--cases={args.cases!r}, --rounds={args.rounds}")
    out: dict = {"benchmark": "first_step", "rounds": args.rounds, "cases": {}}
    for case in cases:
        runs: dict = {"keras": [], "trainwell": []}
        for r in range(args.rounds):
            order = ["keras", "trainwell"] if r % 2 == 0 else ["trainwell", "keras"]
            for mode in order:
                res = _run(case, mode)
                log(case, mode, f"round {r + 1}:", res)
                runs[mode].append(res)
        row = {}
        for mode, rs in runs.items():
            row[mode] = {"cpu_s": summary(x["cpu_s"] for x in rs), "wall_s": summary(x["wall_s"] for x in rs),
                         "train_traces": sorted({x["train_traces"] for x in rs})}
        row["cpu_trainwell_vs_keras"] = rnd(row["trainwell"]["cpu_s"]["median"] / row["keras"]["cpu_s"]["median"], 3)
        row["wall_trainwell_vs_keras"] = rnd(row["trainwell"]["wall_s"]["median"] / row["keras"]["wall_s"]["median"],
                                             3)
        out["cases"][case] = row
    out["machine"] = machine_info()
    print_json(out)


if __name__ == "__main__":
    main()
