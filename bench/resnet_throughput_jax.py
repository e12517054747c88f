"""ResNet-50 training throughput on Keras 3's JAX backend: for GPU machines without TensorFlow.

`bench/resnet_throughput.py` measures the recipe as `train()` runs it, on TensorFlow.
Some accelerator machines have JAX and PyTorch but no TensorFlow, and a TensorFlow
build with its CUDA libraries is too large to bring along (the GPU machine this
project borrows has no network and takes 64 MiB per call). This script measures what
of the recipe does not depend on TensorFlow, on Keras 3's JAX backend: the recipe's
model (`resnet_imagenet.build_model`: ResNet-50 v1.5, zero-init residual gammas,
Keras BatchNorm since the fused kernel is TensorFlow's), its optimizer and loss
(`compile_model`: SGD + Nesterov, decoupled weight decay without BatchNorm/bias,
warmup-cosine schedule, label smoothing 0.1 on one-hot labels) and plain `fit`. It
does NOT measure the TensorFlow input pipeline, `MirroredStrategy` or the recipe's
callbacks. Side by side, in the same run:

- `apps-...`: `keras.applications.ResNet50(weights=None)`, SGD with momentum, sparse
  categorical cross-entropy, plain `fit`: what a user writes by hand with Keras;
- `torch-amp`: torchvision's `resnet50()` in a plain PyTorch loop (channels-last,
  `torch.autocast` float16 with a `GradScaler`, SGD + Nesterov, cuDNN autotuning):
  the usual PyTorch mixed-precision recipe (NVIDIA's DeepLearningExamples do the
  same), as a reference for what this GPU does with ResNet-50. Each round is a fresh
  subprocess whose first `--torch-warmup-steps` steps are excluded.

Config names: `recipe-` or `apps-`, then `f32` / `mixed` (mixed_float16) / `bf16`
(mixed_bfloat16), then `speN` (`steps_per_execution`), then `+stack` for the recipe's
model trained with trainwell's per-step callbacks (`NaNRollback` and `Checkpoint` at
their defaults, `EarlyStopping`; a fresh checkpoint directory per round, so nothing is
resumed; the epoch-end save falls outside the timed steps); and `torch-amp`.
`recipe-...+stack / recipe-...` is the per-step cost of the callbacks (issue #21:
at least 0.98, i.e. within 2 % of the bare `fit`). All Keras
configs compile with XLA (JAX always does). Data: one fixed batch of random,
already-normalised 224 px images and labels, placed on the device once, so neither
host decoding nor host-to-device copies are measured.

Method: each configuration is built and warmed up once (compilation and the first
executions excluded); then `--rounds` rounds run every configuration in turn. A Keras
round is one `fit` of one warm-up execution plus `--steps` timed steps, timed between
the ends of executions (`StepTimer`: the loss of the execution is read, i.e. the
device finished it). A `--budget-s` wall-clock budget skips configurations that would
not fit (listed in the JSON), and the JSON so far is written to `--out` after every
stage, so a run cut short still reports what it measured. Prints one JSON object.

Run (GPU machine with JAX, Keras 3.15, numpy, pyyaml; PyTorch + torchvision for the
reference):
    python bench/resnet_throughput_jax.py --out result.json
    python bench/resnet_throughput_jax.py --configs recipe-mixed-spe8,apps-mixed-spe8 --steps 48
    python bench/resnet_throughput_jax.py --batch 4 --image-size 64 --steps 4 --configs recipe-f32-spe2  # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "jax")
# JAX takes 75% of the GPU's memory up front by default; the PyTorch reference runs beside it.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import StepTimer, log, machine_info, print_json, ratio, rnd  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULT_CONFIGS = "recipe-mixed-spe8,apps-mixed-spe8,torch-amp,recipe-mixed-spe1,recipe-bf16-spe8,recipe-f32-spe8"
PRECISIONS = {"f32": "float32", "mixed": "mixed_float16", "bf16": "mixed_bfloat16"}


def parse_config(name: str) -> dict:
    """`"recipe-mixed-spe8"` -> `{"kind": "recipe", "precision": "mixed_float16", "spe": 8}`."""
    if name == "torch-amp":
        return {"name": name, "kind": "torch", "precision": "mixed_float16", "spe": 1}
    m = re.fullmatch(r"(recipe|apps)-(f32|mixed|bf16)(?:-spe(\d+))?(\+(?:stack|nan|ckpt|es))?", name)
    if not m or (m.group(3) and int(m.group(3)) < 1) or (m.group(4) and m.group(1) != "recipe"):
        raise ValueError(
            "Invalid config. Expected 'recipe-' or 'apps-' + 'f32'/'mixed'/'bf16' [+ '-speN'] (recipe only: "
            f"[+ '+stack' / '+nan' / '+ckpt' / '+es']), or 'torch-amp'. Received: {name!r}"
        )
    return {"name": name, "kind": m.group(1), "precision": PRECISIONS[m.group(2)], "spe": int(m.group(3) or 1),
            "stack": m.group(4)[1:] if m.group(4) else None}


def _import_recipe():
    """`trainwell.recipes.resnet_imagenet`, also from a checkout that is not pip-installed."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    try:
        from trainwell.recipes import resnet_imagenet
    except ModuleNotFoundError:
        import trainwell

        # pyproject maps trainwell.recipes -> recipes/ and trainwell.callbacks -> callbacks/
        trainwell.__path__.append(str(REPO))
        from trainwell.recipes import resnet_imagenet
    return resnet_imagenet


def _rounds_summary(rounds: list[float]) -> dict:
    """Median images/s over the rounds run so far, and each round's."""
    return {"images_per_s": rnd(statistics.median(rounds), 1) if rounds else None,
            "rounds": [rnd(r, 1) for r in rounds]}


class KerasConfig:
    """One recipe / keras.applications configuration: built once, timed per round."""

    def __init__(self, spec: dict, args):
        import jax
        import keras
        import numpy as np

        self.spec, self.args = spec, args
        self.rounds: list[float] = []
        keras.utils.set_random_seed(0)
        keras.mixed_precision.set_global_policy(spec["precision"])
        t0 = time.perf_counter()
        size, classes, batch = args.image_size, 1000, args.batch
        rng = np.random.default_rng(0)
        x = rng.standard_normal((batch, size, size, 3), dtype=np.float32)
        labels = rng.integers(0, classes, batch)
        if spec["kind"] == "recipe":
            R = _import_recipe()
            cfg = R.Config(dataset="synthetic", model="resnet50", image_size=size, batch_size=batch,
                           precision=spec["precision"], strategy="auto", jit_compile=True,
                           steps_per_execution=spec["spe"], seed=0, verbose="0")
            self.model = R.build_model(cfg, classes, 3)
            # ImageNet at the global batch: 1,281,167 / batch steps per epoch sizes the schedule.
            R.compile_model(cfg, self.model, steps_per_epoch=max(1, 1281167 // batch))
            y = np.eye(classes, dtype=np.float32)[labels]
        else:
            self.model = keras.applications.ResNet50(weights=None, input_shape=(size, size, 3), classes=classes)
            self.model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                               loss="sparse_categorical_crossentropy", metrics=["accuracy"],
                               jit_compile=True, steps_per_execution=spec["spe"])
            y = labels.astype(np.int32)
        self.params = int(sum(np.prod(v.shape) for v in self.model.trainable_weights))
        dev = jax.devices()[0]
        self.x, self.y = jax.device_put(x, dev), jax.device_put(y, dev)
        keras.mixed_precision.set_global_policy("float32")  # the model keeps its own policy
        self.build_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        self._fit(1 + args.warmup_executions)
        self.warmup_s = time.perf_counter() - t0

    def _batches(self):
        while True:
            yield self.x, self.y

    def _stack(self, directory: str) -> list:
        """trainwell's callbacks with per-step work, at their defaults, for one `fit`: all of them
        (`+stack`) or one (`+nan`, `+ckpt`, `+es`), to tell which one costs."""
        from trainwell.callbacks import Checkpoint, EarlyStopping, NaNRollback

        members = {"nan": lambda: NaNRollback(), "ckpt": lambda: Checkpoint(directory, verbose=0),
                   "es": lambda: EarlyStopping(monitor="loss", patience=10)}
        which = list(members) if self.spec["stack"] == "stack" else [self.spec["stack"]]
        return [members[k]() for k in which]

    def host_profile(self, top: int = 25) -> list[str]:
        """One more round under cProfile: the host functions with the most time of their own
        (a wait on the device shows in the function that reads a value back)."""
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        self._fit(1 + max(1, -(-self.args.steps // self.spec["spe"])))
        prof.disable()
        lines = []
        for key, restrict in (("tottime", top), ("cumulative", "trainwell|/callbacks/")):
            buf = io.StringIO()
            stats = pstats.Stats(prof, stream=buf).sort_stats(key)
            stats.print_stats(restrict) if key == "tottime" else stats.print_stats(restrict, top)
            rows = [line for line in buf.getvalue().splitlines() if line.strip()]
            lines += [f"-- by {key}"] + rows[next(i for i, r in enumerate(rows) if "ncalls" in r):]
        return lines

    def _fit(self, executions: int):
        import shutil
        import tempfile

        timer = StepTimer.make()
        steps = executions * self.spec["spe"]
        directory = tempfile.mkdtemp(prefix="trainwell-gpu-check-")  # fresh each fit: nothing to resume
        try:
            callbacks = [timer] + (self._stack(directory) if self.spec.get("stack") else [])
            self.model.fit(self._batches(), steps_per_epoch=steps, epochs=1, verbose=0, callbacks=callbacks)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        return timer

    def run_round(self) -> float:
        executions = 1 + max(1, -(-self.args.steps // self.spec["spe"]))
        timer = self._fit(executions)
        ips = timer.images_per_s(self.args.batch, skip=1)
        self.rounds.append(ips)
        return ips

    def result(self) -> dict:
        return {**_rounds_summary(self.rounds), "trainable_params": self.params,
                "build_s": rnd(self.build_s, 1), "warmup_s": rnd(self.warmup_s, 1)}


class TorchConfig:
    """torchvision ResNet-50, AMP float16, channels-last: one subprocess per round."""

    def __init__(self, spec: dict, args):
        self.spec, self.args = spec, args
        self.rounds: list[float] = []
        self.info: dict = {}

    def run_round(self) -> float:
        a = self.args
        cmd = [sys.executable, __file__, "--torch-worker", "--batch", str(a.batch), "--image-size", str(a.image_size),
               "--steps", str(a.steps), "--torch-warmup-steps", str(a.torch_warmup_steps)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"torch worker failed ({proc.returncode}): {proc.stderr[-2000:]}")
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        self.info = {k: v for k, v in out.items() if k != "images_per_s"}
        self.rounds.append(out["images_per_s"])
        return out["images_per_s"]

    def result(self) -> dict:
        return {**_rounds_summary(self.rounds), **self.info}


def torch_worker(args) -> None:
    import torch
    import torchvision

    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = True
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = torchvision.models.resnet50(num_classes=1000).to(dev).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-5)
    scaler = torch.amp.GradScaler(dev.type)
    loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    x = torch.randn(args.batch, 3, args.image_size, args.image_size, device=dev).to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (args.batch,), device=dev)

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev.type, dtype=torch.float16, enabled=dev.type == "cuda"):
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    t0 = time.perf_counter()
    for _ in range(args.torch_warmup_steps):
        step()
    sync()
    warm = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    float(loss)
    sync()
    seconds = time.perf_counter() - t0
    print(json.dumps({"images_per_s": args.steps * args.batch / seconds, "torch": torch.__version__,
                      "torchvision": torchvision.__version__, "device": str(torch.cuda.get_device_name(0))
                      if dev.type == "cuda" else "cpu", "warmup_s": round(warm, 1)}))


def _environment() -> dict:
    import jax
    import keras

    env = {"keras": keras.__version__, "jax": jax.__version__, "backend": keras.backend.backend(),
           "jax_devices": [str(d) for d in jax.devices()]}
    try:
        env["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                                    capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        env["gpu"] = None
    return env


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help=f"Comma-separated, in priority order. Default: {DEFAULT_CONFIGS}.")
    p.add_argument("--batch", type=int, default=256, help="Global batch (NVIDIA's ResNet-50 mixed-precision batch). Default 256.")
    p.add_argument("--image-size", type=int, default=224, help="Default 224.")
    p.add_argument("--steps", type=int, default=64, help="Timed steps per round. Default 64.")
    p.add_argument("--rounds", type=int, default=2, help="Default 2.")
    p.add_argument("--warmup-executions", type=int, default=2, help="Executions after compilation, before timing. Default 2.")
    p.add_argument("--torch-warmup-steps", type=int, default=20, help="Default 20.")
    p.add_argument("--budget-s", type=float, default=360.0,
                   help="Wall-clock budget: a configuration is not built when less than 120 s is left. Default 360.")
    p.add_argument("--host-profile", action="store_true",
                   help="After the rounds, one more round of each '+' configuration under cProfile (JSON: host_profile).")
    p.add_argument("--out", default=None, help="Also write the JSON here after every stage.")
    p.add_argument("--torch-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("batch", "image_size", "steps", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"Invalid value for --{name.replace('_', '-')}. Expected >= 1. Received: {getattr(args, name)}")
    return args


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args.torch_worker:
        torch_worker(args)
        return None
    specs = [parse_config(c) for c in args.configs.split(",") if c.strip()]
    t_start = time.perf_counter()
    out: dict = {"benchmark": "resnet_throughput_jax", "batch": args.batch, "image_size": args.image_size,
                 "steps": args.steps, "machine": machine_info(), "environment": _environment(),
                 "configs": {}, "skipped": {}, "errors": {}}

    def save():
        out["elapsed_s"] = rnd(time.perf_counter() - t_start, 1)
        if args.out:
            Path(args.out).write_text(json.dumps(out, indent=1))

    runners = {}
    for spec in specs:
        left = args.budget_s - (time.perf_counter() - t_start)
        if left < 120:
            out["skipped"][spec["name"]] = f"budget: {left:.0f} s left"
            continue
        log(f"building {spec['name']} ({left:.0f} s of budget left)")
        try:
            runners[spec["name"]] = TorchConfig(spec, args) if spec["kind"] == "torch" else KerasConfig(spec, args)
        except Exception as e:  # one broken configuration must not lose the others' figures
            out["errors"][spec["name"]] = f"{type(e).__name__}: {e}"[:2000]
            log(f"{spec['name']} failed: {e}")
        save()
    for r in range(args.rounds):
        if r and args.budget_s - (time.perf_counter() - t_start) < 30:
            out["skipped"][f"round {r + 1}"] = "budget"
            break
        for name, runner in list(runners.items()):
            try:
                ips = runner.run_round()
                log(f"round {r + 1} {name}: {ips:.1f} images/s")
            except Exception as e:
                out["errors"][name] = f"{type(e).__name__}: {e}"[:2000]
                runners.pop(name)
            out["configs"][name] = runner.result()
            save()
    if args.host_profile:
        out["host_profile"] = {}
        for name, runner in runners.items():
            if "+" in name:
                try:
                    out["host_profile"][name] = runner.host_profile()
                except Exception as e:
                    out["errors"][f"{name} host_profile"] = f"{type(e).__name__}: {e}"[:2000]
                save()
    res = out["configs"]
    out["ratios"] = {}
    for name in res:
        if name.startswith("recipe") and res[name]["images_per_s"]:
            for base in res:
                if not base.startswith("recipe") and res[base]["images_per_s"]:
                    out["ratios"][f"{name} / {base}"] = ratio(res[name]["images_per_s"], res[base]["images_per_s"])
    stacks = {n: n.split("+")[0] for n in res if "+" in n}
    out["callback_stack"] = {
        f"{n} / {bare}": ratio(res[n]["images_per_s"], res[bare]["images_per_s"])
        for n, bare in stacks.items() if bare in res and res[n]["images_per_s"] and res[bare]["images_per_s"]
    }
    out["callback_stack_target"] = {"target": ">= 0.98 (issue #21: within 2 % of the bare fit)",
                                    "met": all(r >= 0.98 for r in out["callback_stack"].values())
                                    if out["callback_stack"] else None}
    mixed = [(n, v["images_per_s"]) for n, v in res.items() if n.startswith("recipe-mixed") and v["images_per_s"]]
    best = max(mixed, key=lambda t: t[1], default=(None, None))
    out["target"] = {"recipe_mixed_images_per_s": best[1], "config": best[0], "target": ">= 3000 (one H200, 224 px)",
                     "met": None if best[1] is None or args.image_size != 224 else best[1] >= 3000}
    save()
    print_json(out)
    return out


if __name__ == "__main__":
    main()
