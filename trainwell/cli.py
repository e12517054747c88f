"""The `trainwell` command line.

    trainwell train RECIPE [--config FILE] [--set key=value ...]
    trainwell resume RUN_DIR [--set key=value ...]
    trainwell tune RECIPE --tuner {random,bayesian,hyperband,pbt} ...
    trainwell lr-find RECIPE [--config FILE] [--set key=value ...]
    trainwell info

Exit status: 0 success; 1 the run failed (the error is printed); 2 bad input: a
command-line argument, a config key, value or file, a data source or preset, a
damaged run directory (one line, no traceback, and no run directory made); 143 the
run was preempted by SIGTERM after writing a checkpoint (resume it with
`trainwell resume RUN_DIR`). `lr-find` exits 1 when it found no reliable learning
rate (the probes did not learn); it then writes nothing.

Everything that can be checked without training is checked before anything runs,
so `--dry-run` catches it too: the config (`Config.validate()`: names with "did you
mean", paths, the data file's contents) and whether a TFDS dataset is prepared
(`trainwell.data.sources.check_data_ready`).

TensorFlow's C++ start-up lines (CUDA driver probes, CPU feature notes) are not
shown on a machine without an NVIDIA driver, where they are noise; with a driver
every line shows, so a real GPU error does. `TRAINWELL_TF_LOGS=1` shows them all.
TensorFlow is imported only when a command needs it: a typo is reported at once.

`train ... --workers N` / `resume ... --workers N` run N local worker processes
(`trainwell.launch`); the exit status is then the job's: 0, 143 when preempted,
else the status of the first worker that failed (128 + S for a signal S).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.abc
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

from trainwell.config import MAX_SEED, ConfigError
from trainwell.data.sources import DataError

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

#: Environment variable: `1` shows TensorFlow's C++ start-up lines on a CPU-only machine.
TF_LOGS_ENV = "TRAINWELL_TF_LOGS"

# What TensorFlow prints at start-up on a machine without a GPU driver: absl's notice
# that it is not initialised, the CUDA probes (TF_CPP_MIN_LOG_LEVEL does not reach
# these, they are logged before absl is set up), and the CPU feature note.
_TF_STARTUP_NOISE = (
    "All log messages before absl::InitializeLog() is called are written to STDERR",
    "cudart_stub.cc",
    "failed call to cuInit",
    "cpu_feature_guard.cc",
    "To enable the following instructions:",
    "oneDNN custom operations are on",
)


def _has_gpu_driver() -> bool:
    return any(os.path.exists(p) for p in ("/proc/driver/nvidia/version", "/dev/nvidiactl", "/dev/nvidia0"))


@contextlib.contextmanager
def _without_start_up_noise():
    """Sends file descriptor 2 to a temporary file, then writes back what is not start-up noise."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            for line in captured.read().decode("utf-8", "replace").splitlines(keepends=True):
                if not any(noise in line for noise in _TF_STARTUP_NOISE):
                    sys.stderr.write(line)
            sys.stderr.flush()


class _QuietTensorFlowImport(importlib.abc.MetaPathFinder):
    """Finds `tensorflow` once and wraps its import and first device probe in `_without_start_up_noise`.

    TensorFlow is imported when a command first needs it (a typo in a config is
    reported without it), and the C++ lines it prints then are filtered.
    """

    def find_spec(self, name, path=None, target=None):
        if name != "tensorflow":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            with _without_start_up_noise():
                run(module)
                module.config.list_physical_devices("GPU")  # the CUDA probe (cuInit) happens here

        spec.loader.exec_module = exec_module  # this loader instance only
        return spec


def start_tensorflow_quietly() -> None:
    """Filters TensorFlow's C++ start-up lines when (and if) TensorFlow is imported later.

    Only on a machine without an NVIDIA driver, and only when TensorFlow is not imported
    yet: while TensorFlow is imported and probes its devices, file descriptor 2 goes to a
    temporary file (the lines come from C++, before absl logging is set up, so
    `TF_CPP_MIN_LOG_LEVEL` does not reach them); every line that is not known start-up
    noise is then written back to stderr. `TF_CPP_MIN_LOG_LEVEL` defaults to `1` (no
    INFO lines) for the rest of the run. With `TRAINWELL_TF_LOGS=1` nothing changes.

    Example:
    >>> start_tensorflow_quietly()  # doctest: +SKIP
    """
    if "tensorflow" in sys.modules or os.environ.get(TF_LOGS_ENV, "") not in ("", "0"):
        return
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    if _has_gpu_driver() or any(isinstance(f, _QuietTensorFlowImport) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _QuietTensorFlowImport())


def _recipe_module(name: str):
    from trainwell.config import did_you_mean
    from trainwell.recipes import RECIPES

    if name not in RECIPES:
        raise ConfigError(f"Unknown recipe {name!r}.{did_you_mean(name, RECIPES)} Expected one of: {', '.join(RECIPES)}.")
    return importlib.import_module(f"trainwell.recipes.{RECIPES[name]}")


def _checked_config(module, path=None, overrides=None, base=None):
    """The recipe's config from `--config`/`--set` (validated), with its data ready to read."""
    from trainwell.data.sources import check_data_ready

    cfg = module.Config.load(path, overrides, base=base)
    check_data_ready(cfg.dataset, getattr(cfg, "data_dir", None))
    return cfg


def _print_result(run) -> None:
    print()
    print("Run finished.")
    for k, v in (run.metrics or {}).items():
        print(f"  {k}: {v:.4f}" if isinstance(v, float) else f"  {k}: {v}")
    print(f"  run directory: {run.run_dir}")
    plots = sorted(str(p) for p in Path(run.run_dir).glob("*.png"))
    if plots:
        print("  plots: " + ", ".join(plots))


def _finish(run) -> int:
    """Prints the result, then waits for the other workers of a multi-worker run.

    Each worker ends here, so none exits while the chief still evaluates, plots or
    exports: TensorFlow's coordination service (hosted by the chief) would take a peer
    that is gone for a crash and print "The tasks have crashed" at the end of a run
    that succeeded.
    """
    from trainwell import runtime

    _print_result(run)
    sys.stdout.flush()
    runtime.sync_workers(getattr(run.model, "distribute_strategy", None))
    return EXIT_OK


def _int_arg(lo: int, hi: int | None = None):
    """An argparse type: an integer in [lo, hi], else a one-line usage error (exit 2)."""

    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            n = None
        if n is None or n < lo or (hi is not None and n > hi):
            bound = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]"
            raise argparse.ArgumentTypeError(f"expected {bound}. Received: {value!r}")
        return n

    return parse


def _seconds(value: str) -> float:
    try:
        s = float(value)
    except ValueError:
        s = float("nan")
    if not s > 0 or s == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0. Received: {value!r}")
    return s


def _launch_workers(args, argv: list[str]) -> int:
    """Runs `argv` (a `trainwell` command) as `args.workers` local workers; see `trainwell.launch`."""
    from trainwell import launch

    argv = list(argv)
    for s in args.set:
        argv += ["--set", s]
    return launch.launch(launch.worker_command(argv), args.workers)


def cmd_train(args) -> int:
    module = _recipe_module(args.recipe)
    cfg = _checked_config(module, args.config, args.set)
    if args.dry_run:
        print(json.dumps(cfg.to_dict(), indent=2))
        return EXIT_OK
    if getattr(args, "workers", None):
        from trainwell import rundir

        # One run directory for every worker: named here, passed to all.
        run_dir = rundir.make_run_dir(cfg.run_dir, prefix=args.recipe)
        argv = ["train", args.recipe] + (["--config", args.config] if args.config else [])
        args.set = list(args.set) + [f"run_dir={run_dir}"]
        return _launch_workers(args, argv)
    return _finish(module.train(cfg))


def _read_manifest(run_dir: Path) -> dict:
    """The manifest of a run directory; anything damaged is a one-line `ConfigError`."""
    path = run_dir / "manifest.json"
    if not path.is_file():
        raise ConfigError(f"Not a trainwell run directory (no manifest.json): {str(run_dir)!r}")
    try:
        manifest = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"Damaged {str(path)!r}: not UTF-8 text (byte offset {e.start}).") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"Damaged {str(path)!r}: not valid JSON ({e.msg}, line {e.lineno}).") from None
    except RecursionError:
        raise ConfigError(f"Damaged {str(path)!r}: nested too deeply.") from None
    if not isinstance(manifest, dict):
        raise ConfigError(f"Damaged {str(path)!r}: expected a JSON object. Received: {type(manifest).__name__}")
    config = manifest.get("config")
    if config is not None and not isinstance(config, dict):
        raise ConfigError(
            f"Damaged {str(path)!r}: its `config` must be a mapping of field names to values. "
            f"Received: {type(config).__name__}"
        )
    return manifest


def cmd_resume(args) -> int:
    from trainwell.config import did_you_mean
    from trainwell.recipes import RECIPES

    run_dir = Path(args.run_dir)
    manifest = _read_manifest(run_dir)
    recipe = manifest.get("recipe")
    if not isinstance(recipe, str) or recipe not in RECIPES:
        hint = did_you_mean(recipe, RECIPES) if isinstance(recipe, str) else ""
        raise ConfigError(f"The manifest in {str(run_dir)!r} names no known recipe.{hint} Received: recipe={recipe!r}")
    module = _recipe_module(recipe)
    base = dict(manifest.get("config") or {})
    base["run_dir"] = str(run_dir)
    cfg = _checked_config(module, overrides=args.set, base=base)
    if args.dry_run:
        print(json.dumps(cfg.to_dict(), indent=2))
        return EXIT_OK
    if getattr(args, "workers", None):
        return _launch_workers(args, ["resume", str(run_dir)])
    return _finish(module.train(cfg))


def cmd_tune(args) -> int:
    from trainwell import tuning

    return int(tuning.main(args) or 0)


def cmd_lr_find(args) -> int:
    from trainwell.callbacks import lr_finder

    module = _recipe_module(args.recipe)
    cfg = _checked_config(module, args.config, args.set)
    return int(lr_finder.cli_main(module, cfg, args) or 0)


def cmd_info(args) -> int:
    from trainwell import rundir, runtime
    from trainwell.data import embedded

    info = {"versions": rundir.package_versions()}
    try:
        info["devices"] = [f"{d['type']} {d['name']}" for d in rundir.device_summary()]
        caps = runtime.gpu_compute_capabilities()
        info["precision"] = {
            "auto": runtime.resolve_precision("auto"),
            "mixed_float16": "fast (tensor cores)" if caps and all(c >= (7, 0) for c in caps) else "runs, slowly (no tensor cores)",
            "mixed_bfloat16": "fast" if caps and all(c >= (8, 0) for c in caps) else "runs, slowly",
        }
    except Exception as e:  # pragma: no cover - broken TF install
        info["devices"] = [f"unavailable: {e}"]
    info["embedded"] = {k: ("present" if v else "missing") for k, v in embedded.available().items()}
    from trainwell.recipes import RECIPES

    info["recipes"] = {name: f"trainwell.recipes.{mod}" for name, mod in RECIPES.items()}
    if args.json:
        print(json.dumps(info, indent=2))
        return EXIT_OK
    print(f"trainwell {info['versions'].get('trainwell', '?')}")
    print("versions:")
    for k, v in info["versions"].items():
        print(f"  {k:22s} {v}")
    print("devices:")
    for d in info["devices"]:
        print(f"  {d}")
    if "precision" in info:
        print("precision:")
        for k, v in info["precision"].items():
            print(f"  {k:22s} {v}")
    print("embedded data and models:")
    for k, v in info["embedded"].items():
        print(f"  {k:22s} {v}")
    print("recipes:")
    for k, v in info["recipes"].items():
        print(f"  {k:22s} {v}")
    return EXIT_OK


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse exits 2 too; keep its one-line format
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the `trainwell` command.

    Example:
    >>> build_parser().parse_args(["info"]).command
    'info'
    """
    from trainwell.recipes import RECIPES

    p = _Parser(prog="trainwell", description="Keras training recipes that survive NaNs, preemption and crashes.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def add_config_args(sp):
        sp.add_argument("--config", metavar="FILE", help="YAML or JSON file of config values")
        sp.add_argument(
            "--set", metavar="KEY=VALUE", action="append", default=[],
            help="override one config value (repeatable), e.g. --set epochs=5",
        )
        sp.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")

    t = sub.add_parser("train", help="train a recipe")
    t.add_argument("recipe", metavar="RECIPE", help=f"one of: {', '.join(RECIPES)}")
    add_config_args(t)
    t.add_argument("--workers", type=_int_arg(1), metavar="N",
                   help="run N local MultiWorkerMirroredStrategy workers on 127.0.0.1 (see trainwell.launch)")
    t.set_defaults(func=cmd_train)

    r = sub.add_parser("resume", help="resume a run from its directory")
    r.add_argument("run_dir", metavar="RUN_DIR")
    r.add_argument("--set", metavar="KEY=VALUE", action="append", default=[], help="override a config value")
    r.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
    r.add_argument("--workers", type=_int_arg(1), metavar="N", help="resume with N local workers (see trainwell.launch)")
    r.set_defaults(func=cmd_resume)

    tu = sub.add_parser("tune", help="hyperparameter search with KerasTuner")
    tu.add_argument("recipe", metavar="RECIPE", help=f"one of: {', '.join(RECIPES)}, or module:factory")
    tu.add_argument("--tuner", choices=["random", "bayesian", "hyperband", "pbt"], default="random")
    tu.add_argument("--max-trials", type=_int_arg(1), default=10, help="trials of random/bayesian search")
    tu.add_argument("--workers", type=_int_arg(0), default=0,
                    help="run KerasTuner's chief + N workers on this machine (gRPC, no authentication)")
    tu.add_argument("--directory", metavar="D", default="tuning", help="parent directory of the search")
    tu.add_argument("--project-name", help="subdirectory of the search (default: RECIPE-TUNER)")
    tu.add_argument("--overwrite", action="store_true", help="start afresh instead of continuing")
    tu.add_argument("--max-epochs", type=_int_arg(1), help="epochs per model for hyperband and pbt")
    tu.add_argument("--population-size", type=_int_arg(2), help="pbt population (default 4)")
    tu.add_argument("--ready-interval", type=_int_arg(1), help="pbt epochs between exploit/explore (default 1)")
    tu.add_argument("--objective", help="metric to optimise (default: the recipe's, val_accuracy)")
    tu.add_argument("--seed", type=_int_arg(0, MAX_SEED), help="oracle seed (default 0)")
    tu.add_argument("--top-k", type=_int_arg(1), help="rows of the printed summary (default 10)")
    tu.add_argument("--no-export", action="store_true", help="do not export the best model")
    tu.add_argument("--oracle-host", default="127.0.0.1", help="address of the chief oracle with --workers")
    tu.add_argument("--oracle-port", type=_int_arg(1, 65535), help="its port (default: a free one)")
    tu.add_argument("--timeout", type=_seconds, help="seconds before a --workers search is stopped")
    add_config_args(tu)
    tu.set_defaults(func=cmd_tune)

    lf = sub.add_parser("lr-find", help="run the LR range test on a recipe")
    lf.add_argument("recipe", metavar="RECIPE")
    lf.add_argument("--write", action="store_true", help="write the suggestion into the config file")
    lf.add_argument("--method", choices=("probe", "peak", "minimum", "steep", "valley"),
                    help="which suggestion (default probe: short warmup + cosine runs around the range test's "
                         "loss minimum, the best of which gives the schedule's peak LR)")
    lf.add_argument("--probe-steps", type=_int_arg(1), metavar="N",
                    help="steps of each probe run (default: the range test's 100); longer is closer to a full run")
    lf.add_argument("--verbose", type=int, choices=(0, 1, 2), default=1,
                    help="0 silent, 1 a progress bar per phase (default), 2 one line per phase")
    add_config_args(lf)
    lf.set_defaults(func=cmd_lr_find)

    i = sub.add_parser("info", help="versions, devices, precision support, embedded data")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=cmd_info)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `trainwell` command; returns the exit status.

    Example:
    >>> main(["info", "--json"])  # doctest: +SKIP
    0
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    start_tensorflow_quietly()
    try:
        return args.func(args)
    except (ConfigError, DataError) as e:
        # One line: a message that spans lines (a library's) is cut at its first.
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        print(f"trainwell: error: {first}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("trainwell: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
