"""ResNet-50 training throughput: the recipe vs plain Keras vs TF Model Garden.

Trains ResNet-50 (224 px, 1000 classes) on synthetic data (one fixed batch of random,
already-normalised images: no decoding, so the model and the training loop are
measured, not the input pipeline) and prints one JSON object with training images/s
of each configuration. One script (~700 lines) because a bench runs as one file: the
configurations, the alternating rounds and the callback profile share one runner and
one JSON; what other benches share is in `bench/_common.py`. A configuration is a name
made of dash-separated tokens:

- `recipe-...`: `trainwell.recipes.resnet_imagenet` as `train()` sets it up: its
  `synthetic` data source, `build_model` (ResNet v1.5), `build_optimizer` (SGD +
  Nesterov, decoupled weight decay, warmup-cosine schedule), categorical
  cross-entropy with label smoothing 0.1, the recipe's strategy (`--strategy`,
  default `"auto"`, i.e. `MirroredStrategy` on GPUs) and `build_callbacks` (NaN
  rollback, training doctor, checkpoints, CSV and TensorBoard logs). `-nocb` drops
  the callbacks, which isolates their per-step cost.
- `apps-...`: the baseline a user writes by hand: `keras.applications.ResNet50(
  weights=None)`, SGD with momentum, sparse categorical cross-entropy on integer
  labels, plain `model.fit`, no strategy, no callbacks.
- `modelgarden-...`: TF Model Garden's custom-training-loop ResNet-50
  (`python -m official.legacy.image_classification.resnet.resnet_ctl_imagenet_main
  --use_synthetic_data`), run as a subprocess in its own virtual environment
  (`--modelgarden-python`, default `bench/.venv-modelgarden/bin/python`; install it with
  `python3.11 -m venv bench/.venv-modelgarden &&
  bench/.venv-modelgarden/bin/pip install tf-models-official==2.20.0`). Its
  images/s are read from the wall-clock timestamps of its per-loop `TimeHistory` log
  lines. It always runs at 224 px.

Tokens after the kind: `f32` or `mixed` (mixed_float16; required), `xla` / `noxla`
(`jit_compile=True/False`; absent: Keras's `"auto"`, which is off on CPUs and under a
distribution strategy), `speN` (`steps_per_execution=N`; Model Garden's
`--steps_per_loop=N`), `nocb` (recipe only), `kerasbn` (recipe only: the model with
Keras 3's own, unfused `BatchNormalization` instead of trainwell's
`FusedBatchNormalization`, the recipe's default on TensorFlow; it shows what the fused
kernel buys). Examples: `recipe-f32`, `recipe-f32-kerasbn`,
`recipe-mixed-xla-spe8`, `apps-mixed-xla`, `modelgarden-f32`.

Method: every configuration is built and warmed up once (tracing / XLA compilation
and the first steps are excluded); then `--rounds` rounds run every configuration in
turn (ours and the baselines alternate, so all see the same load on a shared
machine). In a round, an in-process configuration runs one `fit` of one warm-up
execution plus `--steps` timed steps; images/s = timed steps x batch / wall time
between the end of the warm-up execution and the end of the last execution (a
`StepTimer` callback records when each execution's loss is ready). A Model Garden
round is a fresh subprocess whose first `--mg-warmup` loops are excluded. Every
configuration also reports images per second of process CPU time (`images_per_cpu_s`;
Model Garden's read from /proc at each of its log lines), the per-image cost, which on
a shared machine depends far less on other people's load than wall-clock images/s.
The JSON has the median over rounds of each configuration and, per recipe
configuration, the ratio to each baseline of the same precision (median of the
per-round ratios, and the ratio of images per CPU-second).

Run:
    python bench/resnet_throughput.py                      # CPU: batch 16, 224 px, 5-8 min
    python bench/resnet_throughput.py --device gpu         # GPU: batch 256, mixed precision, < 5 min
    python bench/resnet_throughput.py --configs recipe-f32,recipe-f32-xla,apps-f32 --steps 6
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from _common import StepTimer, load_avg, log, machine_info, print_json, ratio, rnd  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
MG_MODULE = "official.legacy.image_classification.resnet.resnet_ctl_imagenet_main"
MG_IMAGE_SIZE = 224  # Model Garden's synthetic ImageNet input is fixed at 224 px

DEFAULTS = {
    # CPU: the comparison of the issue (batch 16, 224 px, float32), small step counts.
    "cpu": dict(batch=16, steps=4, rounds=2, mg_warmup=2,
                configs="recipe-f32,recipe-f32-kerasbn,apps-f32,modelgarden-f32"),
    # GPU: batch 256, mixed precision, in order of priority (a config that would not fit
    # the time budget is skipped): the fastest setting, the plain keras.applications
    # baseline, the recipe's own default on one GPU (MirroredStrategy, jit "auto" = off,
    # steps_per_execution 1), then XLA / steps_per_execution / float32 / callbacks apart.
    "gpu": dict(batch=256, steps=48, rounds=2, mg_warmup=2,
                configs="recipe-mixed-xla-spe8,apps-mixed,recipe-mixed,recipe-mixed-xla,recipe-mixed-spe8,"
                        "recipe-f32-xla-spe8,recipe-mixed-xla-spe8-nocb,modelgarden-mixed-xla-spe8"),
}


# --------------------------------------------------------------------------- configs
def parse_config(name: str) -> dict:
    """`"recipe-mixed-xla-spe8"` -> `{"kind": "recipe", "precision": "mixed_float16", ...}`."""
    tokens = name.strip().lower().split("-")
    kind, rest = tokens[0], tokens[1:]
    if kind not in ("recipe", "apps", "modelgarden"):
        raise ValueError(f"Invalid config {name!r}: starts with 'recipe', 'apps' or 'modelgarden'.")
    spec = {"name": name, "kind": kind, "precision": None, "jit_compile": "auto", "spe": 1, "callbacks": True,
            "keras_bn": False}
    for t in rest:
        if t in ("f32", "fp32", "float32"):
            spec["precision"] = "float32"
        elif t in ("mixed", "fp16", "mixed_float16"):
            spec["precision"] = "mixed_float16"
        elif t == "xla":
            spec["jit_compile"] = True
        elif t == "noxla":
            spec["jit_compile"] = False
        elif re.fullmatch(r"spe\d+", t) and int(t[3:]) >= 1:
            spec["spe"] = int(t[3:])
        elif t == "nocb" and kind == "recipe":
            spec["callbacks"] = False
        elif t == "kerasbn" and kind == "recipe":
            spec["keras_bn"] = True
        else:
            raise ValueError(f"Invalid config {name!r}: unknown token {t!r}.")
    if spec["precision"] is None:
        raise ValueError(f"Invalid config {name!r}: give a precision token, 'f32' or 'mixed'.")
    return spec


def _sync_only():
    import keras

    class _SyncOnly(keras.callbacks.Callback):
        """Overrides a batch hook and does nothing: what any not-async-safe callback costs."""

        def on_train_batch_end(self, batch, logs=None):
            pass

    return _SyncOnly()


def targets(device: str, runners: dict, ratios: dict) -> dict:
    """The issue's targets and whether this run met them."""
    out = {}
    if device == "cpu":
        key = next((k for k in ratios if k.startswith("recipe-f32") and k.endswith("modelgarden-f32")), None)
        value = ratios[key]["median_of_round_ratios"] if key else None
        out["recipe_over_modelgarden_f32_cpu"] = {
            "target": ">= 1.0", "config": key, "value": value, "met": None if value is None else value >= 1.0,
            # the same comparison in images per CPU-second, robust to other load on a shared machine
            "images_per_cpu_s_ratio": ratios[key].get("images_per_cpu_s_ratio") if key else None,
        }
    else:
        best = max(((n, r.result()["images_per_s"]) for n, r in runners.items()
                    if n.startswith("recipe") and isinstance(r, InProcess) and r.spec["precision"] == "mixed_float16"
                    and r.rounds), key=lambda x: x[1], default=(None, None))
        out["recipe_mixed_images_per_s_gpu"] = {"target": ">= 3000", "config": best[0], "value": best[1],
                                                "met": None if best[1] is None else best[1] >= 3000}
    return out


class InProcess:
    """One recipe or keras.applications configuration, built once, timed per round."""

    def __init__(self, spec: dict, args, strategy, tmp: Path):
        self.spec, self.args, self.tmp = spec, args, tmp
        self.strategy = strategy
        self.rounds: list[float] = []
        self.round_steps: list[tuple[int, float]] = []
        self.cpu_rounds: list[float] = []
        self.fit_overheads: list[tuple[float, float]] = []
        self._chunk = 0
        t0 = time.perf_counter()
        if spec["kind"] == "recipe":
            self._build_recipe()
        else:
            self._build_apps()
        self.build_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        self._fit(executions=1 + args.warmup_executions)  # tracing / XLA compile + first steps
        self.warmup_s = time.perf_counter() - t0

    # -- the recipe, as resnet_imagenet.train() sets it up
    def _build_recipe(self):
        import keras

        from trainwell.compat.learning_rate import raw_learning_rate
        from trainwell.recipes import resnet_imagenet as R

        a, s = self.args, self.spec
        self.cfg = R.Config(
            dataset="synthetic", model=s.get("model", "resnet50"), image_size=s.get("image_size", a.image_size),
            batch_size=s.get("batch", a.batch), width=s.get("width", 64),
            precision=s["precision"], strategy=a.strategy, seed=0,
            jit_compile=None if s["jit_compile"] == "auto" else s["jit_compile"],
            steps_per_execution=s["spe"], verbose="0", run_dir=str(self.tmp / s["name"]),
            fused_batchnorm=False if s["keras_bn"] else None,
        )
        keras.mixed_precision.set_global_policy(s["precision"])
        data = R.build_data(self.cfg)
        self.dataset, self.steps_per_epoch = data.train, data.steps_per_epoch
        with self.strategy.scope():
            model = R.build_model(self.cfg, data.num_classes, data.channels)
            model.compile(
                optimizer=R.build_optimizer(self.cfg, self.steps_per_epoch),
                loss=keras.losses.CategoricalCrossentropy(label_smoothing=self.cfg.label_smoothing),
                metrics=["accuracy"],
                jit_compile="auto" if self.cfg.jit_compile is None else self.cfg.jit_compile,
                steps_per_execution=self.cfg.steps_per_execution,
            )
        self.model = model
        self.schedule = raw_learning_rate(model.optimizer)  # what the recipe hands its callbacks
        keras.mixed_precision.set_global_policy("float32")

    @property
    def batch(self) -> int:
        return self.spec.get("batch", self.args.batch)

    def _recipe_callbacks(self) -> list:
        if not self.spec["callbacks"]:
            return []
        from trainwell.recipes import resnet_imagenet as R

        # A fresh run directory per fit: the recipe's Checkpoint resumes from its
        # directory, and every timed fit must start like a new run.
        self._chunk += 1
        run_dir = self.tmp / self.spec["name"] / f"fit{self._chunk}"
        run_dir.mkdir(parents=True, exist_ok=True)
        return R.build_callbacks(self.cfg, run_dir, schedule=self.schedule, chief=True)

    # -- the hand-written baseline
    def _build_apps(self):
        import keras

        from trainwell.data.images import build_image_datasets

        a, s = self.args, self.spec
        keras.mixed_precision.set_global_policy(s["precision"])
        data = build_image_datasets("synthetic", a.image_size, a.batch, one_hot=False, seed=0)
        self.dataset, self.steps_per_epoch = data.train, data.steps_per_epoch
        model = keras.applications.ResNet50(weights=None, classes=1000, input_shape=(a.image_size, a.image_size, 3))
        model.compile(
            optimizer=keras.optimizers.SGD(learning_rate=0.1, momentum=0.9),
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
            jit_compile=s["jit_compile"],
            steps_per_execution=s["spe"],
        )
        self.model = model
        keras.mixed_precision.set_global_policy("float32")

    def _fit(self, executions: int, keep: set | None = None):
        timer = StepTimer.make()
        callbacks = self._recipe_callbacks() if self.spec["kind"] == "recipe" else []
        if keep is not None:
            callbacks = [c for c in callbacks if type(c).__name__ in keep]
            if "_SyncOnly" in keep:
                callbacks.append(_sync_only())
        if keep is None:
            self.callback_names = [type(c).__name__ for c in callbacks]
        callbacks.append(timer)
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(sys.stderr):  # stdout carries only the JSON
            self.model.fit(self.dataset, epochs=1, steps_per_epoch=executions * self.spec["spe"],
                           callbacks=callbacks, verbose=0)
        t1 = time.perf_counter()
        ends = [t for _, t, _ in timer.ends]
        timer.fit_start_s = min(ends) - t0  # fit call -> end of the first execution
        timer.fit_end_s = t1 - max(ends)  # end of the last execution -> fit returns (epoch-end work)
        return timer

    def run_round(self) -> float:
        spe = self.spec["spe"]
        timed_execs = max(1, -(-self.args.steps // spe))
        timer = self._fit(executions=1 + timed_execs)
        steps, seconds, cpu = timer.timed(skip=1)
        ips = steps * self.batch / seconds
        self.rounds.append(ips)
        self.cpu_rounds.append(steps * self.batch / max(cpu, 1e-9))
        self.round_steps.append((steps, seconds))
        self.fit_overheads.append((timer.fit_start_s, timer.fit_end_s))
        return ips

    def result(self) -> dict:
        s = self.spec
        out = {
            "images_per_s": rnd(statistics.median(self.rounds)) if self.rounds else None,
            "rounds_images_per_s": [rnd(x) for x in self.rounds],
            "timed_steps_per_round": self.round_steps[0][0] if self.round_steps else None,
            # images per second of process CPU time: the per-image cost, which depends far
            # less than wall-clock images/s on how busy a shared machine is
            "images_per_cpu_s": rnd(statistics.median(self.cpu_rounds), 3) if self.cpu_rounds else None,
            # per fit() call, outside the timed steps: start (callbacks' on_train_begin, the
            # first execution) and end (epoch-end work: checkpoint, logs)
            "fit_start_s": [rnd(a, 2) for a, _ in self.fit_overheads],
            "fit_end_s": [rnd(b, 2) for _, b in self.fit_overheads],
            "precision": s["precision"],
            "jit_compile": s["jit_compile"],
            "jit_compile_resolved": bool(getattr(self.model, "jit_compile", False)),
            "keras_batchnorm": s.get("keras_bn", False),
            "steps_per_execution": s["spe"],
            "batch_size": self.batch,
            "build_s": rnd(self.build_s, 1),
            "warmup_s": rnd(self.warmup_s, 1),
            "parameters": int(self.model.count_params()),
        }
        if s["kind"] == "recipe":
            # <= 64 px the recipe picks the small-image stem (3x3 stride 1, no max-pool):
            # 16x the activations of the ImageNet stem, not comparable with `apps`
            out["small_stem"] = bool(self.cfg.use_small_stem)
            out["strategy"] = type(self.strategy).__name__
            out["callbacks"] = self.callback_names
        return out


# --------------------------------------------------------------------------- callback profile
PROFILE_VARIANTS = {
    "none": set(),  # only the async-safe StepTimer: Keras keeps batch callbacks asynchronous
    "sync": {"_SyncOnly"},  # a no-op batch callback: Keras turns the logs into numbers every step
    "WarmupCosine": {"WarmupCosine"},
    "NaNRollback": {"NaNRollback"},
    "TrainingDoctor": {"TrainingDoctor"},
    "Checkpoint": {"Checkpoint"},
    "CSVLogger+TensorBoard": {"CSVLogger", "TensorBoard"},
    "all": None,
}


def profile_callbacks(runner: InProcess, steps: int, rounds: int) -> dict:
    """Per-step cost of each of the recipe's callbacks: ms/step over no callbacks.

    Every variant is one `fit` of one warm-up execution plus `steps` timed steps with
    fresh callbacks (as a new run) and the `StepTimer`; variants alternate, `rounds`
    times. Per variant (medians over rounds): `median_ms_per_step`, the median duration
    of one step (robust to other load: the constant per-step cost), `mean_ms_per_step`
    (includes periodic work such as a probe or snapshot every 100 steps),
    `cpu_ms_per_step` (process CPU time / steps), their excess over `none`, and
    `fit_start_s` / `fit_end_s`, the one-off costs per `fit` outside the timed steps.
    """
    spe = runner.spec["spe"]
    execs = max(1, -(-steps // spe))
    keys = ("median", "mean", "cpu", "start", "end")
    rows: dict[str, dict[str, list]] = {k: {x: [] for x in keys} for k in PROFILE_VARIANTS}
    for k in range(rounds):
        names = list(PROFILE_VARIANTS)
        if k % 2:
            names.reverse()
        for name in names:
            timer = runner._fit(executions=1 + execs, keep=PROFILE_VARIANTS[name])
            n, wall, cpu = timer.timed(skip=1)
            ends = sorted(timer.ends)
            per_exec = [(b[1] - a[1]) / (b[0] - a[0]) for a, b in zip(ends, ends[1:])]
            r = rows[name]
            r["median"].append(1000 * statistics.median(per_exec))
            r["mean"].append(1000 * wall / n)
            r["cpu"].append(1000 * cpu / n)
            r["start"].append(timer.fit_start_s)
            r["end"].append(timer.fit_end_s)
        log(f"callback profile round {k + 1}/{rounds} (median ms/step): " + ", ".join(
            f"{n}={rows[n]['median'][-1]:.1f}" for n in PROFILE_VARIANTS))
    base = {x: statistics.median(rows["none"][x]) for x in ("median", "mean", "cpu")}
    out = {}
    for name, r in rows.items():
        m = {x: statistics.median(r[x]) for x in keys}
        out[name] = {
            "median_ms_per_step": rnd(m["median"], 2),
            "extra_median_ms_per_step": rnd(m["median"] - base["median"], 2),
            "mean_ms_per_step": rnd(m["mean"], 2),
            "extra_mean_ms_per_step": rnd(m["mean"] - base["mean"], 2),
            "cpu_ms_per_step": rnd(m["cpu"], 2),
            "extra_cpu_ms_per_step": rnd(m["cpu"] - base["cpu"], 2),
            "fit_start_s": rnd(m["start"], 2),
            "fit_end_s": rnd(m["end"], 2),
        }
    return {
        "model": runner.cfg.model, "width": runner.cfg.width, "image_size": runner.cfg.image_size,
        "batch_size": runner.batch, "parameters": int(runner.model.count_params()),
        "precision": runner.spec["precision"], "jit_compile": runner.spec["jit_compile"],
        "steps_per_execution": spe, "timed_steps": execs * spe, "rounds": rounds, "variants": out,
    }


# --------------------------------------------------------------------------- Model Garden
_MG_LINE = re.compile(
    r"^I(\d{4}) (\d\d):(\d\d):(\d\d\.\d+)\s.*TimeHistory: ([\d.]+) seconds, ([\d.]+) examples/second "
    r"between steps (\d+) and (\d+)"
)


def parse_modelgarden_log(text: str, batch: int, skip_loops: int, cpu_at: dict[int, float] | None = None) -> dict:
    """Images/s from Model Garden's `TimeHistory` lines, skipping the first loops.

    Wall-clock: `batch x steps / (t_last - t_skip)` from the absl timestamps of the
    lines (so, like ours, it includes everything between two loops). Also returns
    Model Garden's own figure (its per-loop seconds, which leave out the time between
    loops) for reference. With `cpu_at` (step -> the subprocess's CPU seconds when that
    line was read), also images per CPU-second.
    """
    points = []
    for line in text.splitlines():
        m = _MG_LINE.match(line.strip())
        if m:
            _, hh, mm, ss, secs, _, _, end = m.groups()
            points.append((int(end), int(hh) * 3600 + int(mm) * 60 + float(ss), float(secs)))
    if len(points) <= skip_loops:
        raise RuntimeError(f"Model Garden logged {len(points)} TimeHistory lines, need more than {skip_loops}.")
    t = [p[1] for p in points]
    for i in range(1, len(t)):  # past midnight
        while t[i] < t[i - 1]:
            t[i] += 86400.0
    s0, t0 = points[skip_loops - 1][0], t[skip_loops - 1]
    s1, t1 = points[-1][0], t[-1]
    own_seconds = sum(p[2] for p in points[skip_loops:])
    out = {
        "steps": s1 - s0,
        "seconds": t1 - t0,
        "images_per_s": batch * (s1 - s0) / (t1 - t0),
        "own_images_per_s": batch * (s1 - s0) / own_seconds,
        "images_per_cpu_s": None,
    }
    if cpu_at and s0 in cpu_at and s1 in cpu_at and cpu_at[s1] > cpu_at[s0]:
        out["images_per_cpu_s"] = batch * (s1 - s0) / (cpu_at[s1] - cpu_at[s0])
    return out


def _proc_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` (all its threads), from /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


class ModelGarden:
    """TF Model Garden's ResNet-50 CTL loop, one subprocess per round."""

    def __init__(self, spec: dict, args, tmp: Path, device: str):
        self.spec, self.args, self.tmp, self.device = spec, args, tmp, device
        self.rounds: list[float] = []
        self.own_rounds: list[float] = []
        self.cpu_rounds: list[float] = []
        self.round_wall: list[float] = []
        self.python = Path(args.modelgarden_python)
        self.available, self.reason, self.versions = self._check()

    def _check(self):
        if self.args.image_size != MG_IMAGE_SIZE:
            return False, f"Model Garden's synthetic input is {MG_IMAGE_SIZE} px; --image-size is {self.args.image_size}", {}
        if not self.python.exists():
            return False, (
                f"{self.python} not found: install Model Garden with `python3.11 -m venv bench/.venv-modelgarden "
                "&& bench/.venv-modelgarden/bin/pip install tf-models-official==2.20.0`"
            ), {}
        code = (
            "import importlib.metadata as m, importlib.util as u;"
            "print(m.version('tf-models-official'), m.version('tensorflow'), m.version('tf-keras'));"
            f"print(u.find_spec('{MG_MODULE}') is not None)"
        )
        try:
            r = subprocess.run([str(self.python), "-c", code], capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.SubprocessError) as e:
            return False, f"cannot run {self.python}: {e!r}", {}
        if r.returncode != 0 or "True" not in r.stdout:
            return False, f"tf-models-official not importable in {self.python}: {r.stderr.strip()[-300:]}", {}
        v = r.stdout.split()[:3]
        return True, None, {"tf-models-official": v[0], "tensorflow": v[1], "tf-keras": v[2]}

    def command(self, model_dir: Path) -> list[str]:
        s, a = self.spec, self.args
        loop = s["spe"]
        cmd = [
            str(self.python), "-m", MG_MODULE,
            "--use_synthetic_data", "--skip_eval", f"--batch_size={a.batch}",
            f"--train_steps={(a.mg_warmup + max(1, -(-a.steps // loop))) * loop}",
            f"--steps_per_loop={loop}", f"--log_steps={loop}",
            f"--model_dir={model_dir}", "--noenable_checkpoint_and_export",
            f"--dtype={'fp16' if s['precision'] == 'mixed_float16' else 'fp32'}",
        ]
        if s["jit_compile"] is True:
            cmd.append("--enable_xla")
        if self.device == "gpu":
            cmd += ["--num_gpus=1", "--distribution_strategy=one_device"]
        else:
            cmd += ["--num_gpus=0", "--distribution_strategy=off"]
        return cmd

    def run_round(self) -> float | None:
        model_dir = Path(tempfile.mkdtemp(prefix="mg-", dir=self.tmp))
        cmd = self.command(model_dir)
        t0 = time.perf_counter()
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
        lines: list[str] = []
        cpu_at: dict[int, float] = {}
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                cwd=str(self.tmp))
        try:
            for line in proc.stdout:  # read as it comes, to sample the CPU time at each TimeHistory line
                lines.append(line)
                m = _MG_LINE.match(line.strip())
                if m:
                    cpu = _proc_cpu_seconds(proc.pid)
                    if cpu is not None:
                        cpu_at[int(m.group(8))] = cpu
                if time.perf_counter() - t0 > self.args.mg_timeout:
                    proc.kill()
                    self.available, self.reason = False, f"Model Garden ran past --mg-timeout={self.args.mg_timeout}s"
                    return None
            rc = proc.wait()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            self.round_wall.append(time.perf_counter() - t0)
            shutil.rmtree(model_dir, ignore_errors=True)
        text = "".join(lines)
        if rc != 0:
            self.available = False
            self.reason = f"Model Garden exited {rc}: {text.strip()[-600:]}"
            return None
        p = parse_modelgarden_log(text, self.args.batch, self.args.mg_warmup, cpu_at)
        self.rounds.append(p["images_per_s"])
        self.own_rounds.append(p["own_images_per_s"])
        if p["images_per_cpu_s"] is not None:
            self.cpu_rounds.append(p["images_per_cpu_s"])
        self.last_command = " ".join(cmd[1:])
        return p["images_per_s"]

    def result(self) -> dict:
        return {
            "available": self.available,
            "reason": self.reason,
            "images_per_s": rnd(statistics.median(self.rounds)) if self.rounds else None,
            "rounds_images_per_s": [rnd(x) for x in self.rounds],
            "own_timehistory_images_per_s": rnd(statistics.median(self.own_rounds)) if self.own_rounds else None,
            "images_per_cpu_s": rnd(statistics.median(self.cpu_rounds), 3) if self.cpu_rounds else None,
            "precision": self.spec["precision"],
            "jit_compile": self.spec["jit_compile"],
            "steps_per_loop": self.spec["spe"],
            "subprocess_wall_s": [rnd(x, 1) for x in self.round_wall],
            "versions": self.versions,
            "command": getattr(self, "last_command", None) or " ".join(self.command(Path("MODEL_DIR"))[1:]),
        }


# --------------------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto",
                   help="Picks the defaults (batch, steps, configs); 'auto': gpu when TensorFlow sees one.")
    p.add_argument("--batch", type=int, help="Global batch size (cpu: 16, gpu: 256).")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--steps", type=int, help="Timed steps per round per config (cpu: 4, gpu: 48).")
    p.add_argument("--rounds", type=int, help="Alternating rounds (default 2).")
    p.add_argument("--warmup-executions", type=int, default=0,
                   help="Untimed executions after the compiling one, at build time (default 0: each timed "
                        "fit also leaves its first execution out).")
    p.add_argument("--configs", help="Comma-separated config names (see the module docstring); 'none' "
                                     "with --profile-callbacks runs the callback profile alone.")
    p.add_argument("--modelgarden", action=argparse.BooleanOptionalAction, default=True,
                   help="Include the Model Garden configs (default: yes).")
    p.add_argument("--modelgarden-python", default=str(REPO / "bench" / ".venv-modelgarden" / "bin" / "python"))
    p.add_argument("--mg-warmup", type=int, help="Model Garden loops excluded from timing (default 2).")
    p.add_argument("--mg-timeout", type=float, default=600.0)
    p.add_argument("--profile-callbacks", action=argparse.BooleanOptionalAction, default=None,
                   help="Also measure the per-step cost of each recipe callback (default: on for gpu, off for cpu).")
    p.add_argument("--profile-model", choices=("small", "main"), default=None,
                   help="Model of the callback profile: 'small' (ResNet-18, width 8, 16 px, batch 32; the "
                        "default on cpu, where a ResNet-50 step hides per-step costs) or 'main' (the first "
                        "recipe config; default on gpu).")
    p.add_argument("--profile-steps", type=int, default=None, help="Timed steps per profile variant (cpu 200, gpu 96).")
    p.add_argument("--profile-rounds", type=int, default=None, help="Alternating profile rounds (cpu 2, gpu 1).")
    p.add_argument("--time-budget", type=float, default=None,
                   help="Soft limit in seconds (cpu 1200, gpu 270): configs, rounds and the profile that "
                        "would not fit are skipped and listed under 'skipped'.")
    p.add_argument("--strategy", default="auto", help="The recipe's strategy (default: 'auto', as the recipe).")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    import tensorflow as tf

    device = args.device
    if device == "auto":
        device = "gpu" if tf.config.list_physical_devices("GPU") else "cpu"
    if device == "gpu" and not tf.config.list_physical_devices("GPU"):
        raise SystemExit("--device gpu: TensorFlow sees no GPU.")
    d = DEFAULTS[device]
    args.batch = args.batch or d["batch"]
    args.steps = args.steps or d["steps"]
    args.rounds = args.rounds or d["rounds"]
    args.mg_warmup = args.mg_warmup or d["mg_warmup"]
    if args.profile_callbacks is None:
        args.profile_callbacks = device == "gpu"
    args.profile_model = args.profile_model or ("main" if device == "gpu" else "small")
    args.profile_steps = args.profile_steps or (96 if device == "gpu" else 200)
    args.profile_rounds = args.profile_rounds or (1 if device == "gpu" else 2)
    args.time_budget = args.time_budget or (270.0 if device == "gpu" else 1200.0)
    names = args.configs or d["configs"]
    specs = [] if names.strip().lower() == "none" else [parse_config(c) for c in names.split(",") if c.strip()]
    if not args.modelgarden:
        specs = [s for s in specs if s["kind"] != "modelgarden"]

    from trainwell import runtime

    machine = machine_info()
    t_start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="trainwell-throughput-"))
    strategy = runtime.make_strategy(args.strategy)
    runners: dict[str, object] = {}
    skipped: list[str] = []

    def elapsed() -> float:
        return time.perf_counter() - t_start

    profile = None
    try:
        for s in specs:
            if runners and elapsed() > 0.5 * args.time_budget:
                skipped.append(f"{s['name']}: not built, {elapsed():.0f}s of the {args.time_budget:.0f}s budget gone")
                log(skipped[-1])
                continue
            if s["kind"] == "modelgarden":
                mg = ModelGarden(s, args, tmp, device)
                log(f"{s['name']}: available={mg.available}" + ("" if mg.available else f" ({mg.reason})"))
                runners[s["name"]] = mg
            else:
                log(f"{s['name']}: building and warming up")
                r = InProcess(s, args, strategy, tmp)
                log(f"{s['name']}: built in {r.build_s:.1f}s, warm-up {r.warmup_s:.1f}s")
                runners[s["name"]] = r
        per_round: list[dict[str, float | None]] = []
        last_round_s = 0.0
        for k in range(args.rounds):
            t_round = time.perf_counter()
            if k and elapsed() + last_round_s > 0.9 * args.time_budget:
                skipped.append(f"rounds {k + 1}-{args.rounds}: over the {args.time_budget:.0f}s budget")
                log(skipped[-1])
                break
            order = list(runners.items())
            if k % 2:
                order.reverse()  # no config always runs first (or right after a subprocess)
            got = {}
            for name, r in order:
                if isinstance(r, ModelGarden) and not r.available:
                    continue
                got[name] = r.run_round()
                log(f"round {k + 1}/{args.rounds} {name}: {got[name] and round(got[name], 2)} images/s")
            per_round.append(got)
            last_round_s = time.perf_counter() - t_round
        if args.profile_callbacks and elapsed() > 0.65 * args.time_budget:
            skipped.append(f"callback profile: {elapsed():.0f}s of the {args.time_budget:.0f}s budget gone")
            log(skipped[-1])
        elif args.profile_callbacks:
            recipes = [r for r in runners.values() if isinstance(r, InProcess)
                       and r.spec["kind"] == "recipe" and r.spec["callbacks"]]
            # steps_per_execution=1 shows the full per-step cost (batch callbacks fire every execution)
            main_recipe = next((r for r in recipes if r.spec["spe"] == 1), recipes[0] if recipes else None)
            if args.profile_model == "main" and main_recipe is not None:
                prof_runner = main_recipe
            else:
                spec = parse_config("recipe-f32" if device == "cpu" else "recipe-mixed")
                spec.update(name="profile-resnet18", model="resnet18", width=8, image_size=16, batch=32)
                log("callback profile: building the small model")
                prof_runner = InProcess(spec, args, strategy, tmp)
            profile = profile_callbacks(prof_runner, args.profile_steps, args.profile_rounds)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    results = {name: r.result() for name, r in runners.items()}
    ratios = {}
    for name, r in runners.items():
        if not name.startswith("recipe"):
            continue
        for base, b in runners.items():
            if base.startswith("recipe") or r.spec["precision"] != b.spec["precision"]:
                continue
            if isinstance(b, ModelGarden) and not b.rounds:
                continue
            rr = [ratio(p.get(name), p.get(base)) for p in per_round]
            rr = [x for x in rr if x is not None]
            entry = {"median_of_round_ratios": rnd(statistics.median(rr), 3) if rr else None, "round_ratios": rr}
            if r.cpu_rounds and b.cpu_rounds:
                entry["images_per_cpu_s_ratio"] = ratio(statistics.median(r.cpu_rounds), statistics.median(b.cpu_rounds))
            ratios[f"{name} / {base}"] = entry
    out = {
        "benchmark": "resnet_throughput",
        "model": "resnet50",
        "device": device,
        "batch_size": args.batch,
        "image_size": args.image_size,
        "timed_steps_per_round": args.steps,
        "rounds": args.rounds,
        "strategy_arg": args.strategy,
        "machine": machine,
        "load_avg_1min_end": load_avg(),
        "configs": results,
        "ratios": ratios,
        "wall_s": rnd(time.perf_counter() - t_start, 1),
    }
    if profile is not None:
        out["callback_profile"] = profile
    out["skipped"] = skipped
    out["targets"] = targets(device, runners, ratios)
    mg = [r for r in runners.values() if isinstance(r, ModelGarden)]
    if any(not r.available for r in mg):
        out["modelgarden_unavailable"] = next(r.reason for r in mg if not r.available)
    print_json(out)
    return out


if __name__ == "__main__":
    main()
