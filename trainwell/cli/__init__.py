"""The `trainwell` command line.

Every command's body is in this package, on the orchestration floor: this module holds
the parser and the commands, `trainwell.cli.lr_find` the `lr-find` command (its public
names are re-exported here). The work itself is in the recipes, `trainwell.tuning`,
`trainwell.launch` and `trainwell.callbacks.lr_finder`.

    trainwell train RECIPE [--config FILE] [--set key=value ...]
    trainwell resume RUN_DIR [--set key=value ...]
    trainwell tune RECIPE --tuner {random,bayesian,hyperband,pbt} ...
    trainwell lr-find RECIPE [--config FILE] [--set key=value ...]
    trainwell data-service --workers N [--port P]
    trainwell info

Exit status: 0 success; 1 the run failed (the error is printed); 2 bad input: a
command-line argument, a config key, value or file, a data source or preset, a
damaged run directory, a directory that cannot be made or written (one line, no
traceback, and no run directory made); 3 training diverged past NaN rollback's
`max_rollbacks` (`TrainingDivergedError`: its message, then the run's last
checkpoint and the `trainwell resume` that continues it at a lower LR; no
traceback); 143 the run was preempted by SIGTERM after writing a checkpoint (resume
it with `trainwell resume RUN_DIR`). `lr-find` exits 1 when it found no reliable
learning rate (the probes did not learn); it then writes nothing into the config.

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
import shutil
import sys
import tempfile
from pathlib import Path

from trainwell import launch, recipes, rundir, runtime, storage
from trainwell.cli.lr_find import (  # noqa: F401 (public names of `trainwell.cli`)
    CLI_METHOD,
    CLI_PROBE_SCHEDULE,
    LR_FIELDS,
    lr_config_updates,
    lr_field,
    lr_find_main,
    write_config_value,
)
from trainwell.cli.data_service import add_data_service_parser
from trainwell.cli.input_report import add_input_report_parser
from trainwell.cli.prepare import add_prepare_parser
from trainwell.config import (
    MAX_SEED,
    ConfigError,
    check_dir_path,
    did_you_mean,
    os_error_reason,
    override_text,
    parse_overrides,
    read_config_file,
)
from trainwell.data import embedded
from trainwell.data.base import DataError
from trainwell.data.sources import check_data_ready
from trainwell.recipes import RECIPES
from trainwell.validation import invalid_value, is_url

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_DIVERGED = 0, 1, 2, 3

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

    if name not in RECIPES:
        raise ConfigError(f"Unknown recipe {name!r}.{did_you_mean(name, RECIPES)} Expected one of: {', '.join(RECIPES)}.")
    return importlib.import_module(f"trainwell.recipes.{RECIPES[name]}")


def _checked_config(module, path=None, overrides=None, base=None):
    """The recipe's config from `--config`/`--set` (validated), with its data ready to read."""
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
    _print_result(run)
    sys.stdout.flush()
    runtime.sync_workers(getattr(run.model, "distribute_strategy", None))
    return EXIT_OK


def _train(module, cfg) -> int:
    """Runs `module.train(cfg)`; a run that diverged past NaN rollback's limit ends in its message, exit 3.

    `NaNRollback` raises `TrainingDivergedError` when rolling back no longer helps; its
    message says what happened, the last good state and what to change. The command
    prints it (no traceback), then where the run's last checkpoint is and the LR field
    to lower, and exits with `EXIT_DIVERGED`.
    """
    try:
        run = module.train(cfg)
    except KeyboardInterrupt:  # Ctrl-C: `main` says "interrupted" (exit 130); say first what continues the run
        run_dir, chosen = _last_checkpoint(cfg)
        if chosen is not None:
            print(f"trainwell: the run directory {run_dir} keeps its last checkpoint ({chosen['name']}): "
                  f"`trainwell resume {run_dir}` continues from it.", file=sys.stderr)
        raise
    except RuntimeError as e:
        # lazy: the error class lives with Keras's callbacks, loaded by now (a run started)
        from trainwell.callbacks.nan_rollback import TrainingDivergedError

        if not isinstance(e, TrainingDivergedError):
            raise
        print(f"trainwell: error: {' '.join(str(e).split())}", file=sys.stderr)
        print(f"trainwell: {_after_divergence(module, cfg)}", file=sys.stderr)
        return EXIT_DIVERGED
    return _finish(run)


def _last_checkpoint(cfg) -> tuple:
    """`(run_dir, the checkpoint a resume would pick or None)` of the run `cfg` names."""
    from trainwell.callbacks.checkpoint import CheckpointCorruptError, resume_checkpoint  # lazy, as in `_train`

    run_dir = getattr(cfg, "run_dir", None)
    try:
        return run_dir, resume_checkpoint(storage.join(str(run_dir), "checkpoints")) if run_dir else None
    except (CheckpointCorruptError, OSError):
        return run_dir, None


def _after_divergence(module, cfg) -> str:
    """Where a diverged run's last checkpoint is, and the LR to try (a tenth), in one line."""
    run_dir, chosen = _last_checkpoint(cfg)
    field = lr_field(module, cfg)
    lower = f"--set {field}={override_text(getattr(cfg, field) / 10)}" if field else "a lower learning rate"
    if chosen is None:
        return f"no checkpoint was written; start again with {lower}."
    epoch = int(chosen["position"].get("epoch", 0))
    return (f"the run directory {run_dir} keeps its last checkpoint ({chosen['name']}, after epoch {epoch}): "
            f"`trainwell resume {run_dir} {lower}` continues from it with a tenth of the learning rate.")


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


def _launch_workers(args, argv: list[str], cfg) -> int:
    """Runs `argv` (a `trainwell` command) as `args.workers` local workers; see `trainwell.launch`.

    Each worker trains with `strategy="multiworker"`, except a run configured with
    `model_parallel:DxM`, whose mesh then spans the workers' devices.
    """
    argv = list(argv)
    for s in args.set:
        argv += ["--set", s]
    spec = str(getattr(cfg, "strategy", ""))
    strategy = spec if spec.startswith("model_parallel:") else "multiworker"
    return launch.launch(launch.worker_command(argv, strategy), args.workers)


def cmd_train(args) -> int:
    module = _recipe_module(args.recipe)
    cfg = _checked_config(module, args.config, args.set)
    if args.dry_run:
        if is_url(str(cfg.run_dir or "")):  # what the run's setup checks first: the bucket, reachable
            storage.store_for(cfg.run_dir).check_bucket("run_dir", what="", error=ConfigError)
        print(json.dumps(cfg.to_dict(), indent=2))
        return EXIT_OK
    if getattr(args, "workers", None):

        # One run directory for every worker: named here, passed to all.
        run_dir = rundir.make_run_dir(cfg.run_dir, prefix=args.recipe)
        argv = ["train", args.recipe] + (["--config", args.config] if args.config else [])
        args.set = list(args.set) + [f"run_dir={run_dir}"]
        return _launch_workers(args, argv, cfg)
    return _train(module, cfg)


def _read_manifest(run_dir: Path) -> dict:
    """The manifest of a run directory; anything damaged is a one-line `ConfigError`."""
    path = run_dir / "manifest.json"
    if os.path.lexists(run_dir) and not run_dir.is_dir():
        raise ConfigError(f"Not a trainwell run directory: {str(run_dir)!r} is a file; expected the run's directory.")
    try:
        if not path.is_file():
            raise ConfigError(f"Not a trainwell run directory (no manifest.json): {str(run_dir)!r}")
        manifest = json.loads(path.read_bytes().decode("utf-8"))
    except OSError as e:
        raise ConfigError(f"Cannot read {str(path)!r}: {os_error_reason(e)}.") from None
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


def _read_url_manifest_path(url: str) -> Path:
    """A local directory holding the `manifest.json` of the run at `url` (for `_read_manifest`)."""
    try:
        data = storage.store_for(storage.check_url(url, "RUN_DIR", what="", error=ConfigError)).get("manifest.json")
    except FileNotFoundError:
        raise ConfigError(f"Not a trainwell run directory (no manifest.json): {url!r}") from None
    except (ValueError, OSError) as e:
        raise ConfigError(" ".join(str(e).split())) from None
    except Exception as e:  # noqa: BLE001 - the driver's own (botocore's EndpointConnectionError, NoCredentialsError...)
        raise ConfigError(f"Cannot read the run at {storage.redact(url)!r}: {type(e).__name__}: "
                          f"{' '.join(str(e).split())}") from None
    local = Path(tempfile.mkdtemp(prefix="trainwell-manifest-"))
    (local / "manifest.json").write_bytes(data)
    return local


def cmd_resume(args) -> int:

    if is_url(args.run_dir):  # a run directory on an object store: its manifest is an object there
        local = _read_url_manifest_path(args.run_dir)
        try:
            manifest = _read_manifest(local)
        finally:
            shutil.rmtree(local, ignore_errors=True)
        run_dir = args.run_dir.rstrip("/")
    else:
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
        return _launch_workers(args, ["resume", str(run_dir)], cfg)
    return _train(module, cfg)


def _child_argv(args) -> list[str]:
    out = ["tune", args.recipe, "--tuner", args.tuner, "--max-trials", str(args.max_trials)]
    for flag, attr in (("--directory", "directory"), ("--project-name", "project_name"), ("--max-epochs", "max_epochs"),
                       ("--population-size", "population_size"), ("--ready-interval", "ready_interval"),
                       ("--seed", "seed"), ("--objective", "objective"), ("--top-k", "top_k")):
        v = getattr(args, attr, None)
        if v is not None:
            out += [flag, str(v)]
    if getattr(args, "config", None):
        out += ["--config", args.config]
    for s in getattr(args, "set", None) or []:
        out += ["--set", s]
    if getattr(args, "no_export", False):
        out.append("--no-export")
    return out


def cmd_tune(args) -> int:
    """`trainwell tune`: runs `tuning.search()` from parsed command-line arguments.

    With `--workers N` (N >= 1) it launches KerasTuner's chief and N workers on this
    machine (`launch.launch_distributed`) and prints the chief's summary.
    """
    # lazy: KerasTuner and TensorFlow load when a search runs, not for `trainwell --help`
    import keras_tuner

    from trainwell import tuning  # lazy: imports KerasTuner and Keras
    from trainwell.compat.keras_tuner import has_chief_oracle, is_chief_oracle  # lazy: imports KerasTuner

    directory = getattr(args, "directory", None) or "tuning"
    workers = int(getattr(args, "workers", 0) or 0)  # >= 0: the parser's `_int_arg(0)` refused the rest
    on_store = is_url(directory)
    if on_store:  # a bad URL or a missing bucket: one line before anything loads
        storage.store_for(storage.check_url(directory, "--directory", what="", error=ConfigError)).check_bucket(
            "--directory", what="", error=ConfigError)
        if workers > 0 or has_chief_oracle():
            raise invalid_value("--directory", "a local or shared directory for a distributed search (a URL is "
                                               "not supported there yet)", directory, what="", error=ConfigError)
    else:
        check_dir_path(directory, "--directory", write=True)  # a file, read-only, permission denied: one line
    hm = _hypermodel_from_args(args)
    check_data_ready(hm.cfg.dataset, getattr(hm.cfg, "data_dir", None))  # e.g. a TFDS set not prepared: one line
    tuning.resolve_objective(hm, getattr(args, "objective", None))  # a name with no direction: one line, also dry
    if not getattr(args, "dry_run", False) and not on_store:
        rundir.make_writable_dir(directory, "--directory", what="search directory")  # what only trying tells (/proc)
    if getattr(args, "dry_run", False):
        hp = keras_tuner.HyperParameters()
        hm.declare_hyperparameters(hp)
        print(json.dumps({"config": hm.cfg.to_dict(), "space": hp.get_config()}, indent=2, default=str))
        return 0
    if workers > 0 and not has_chief_oracle():
        project = getattr(args, "project_name", None) or f"{hm.name or 'search'}-{args.tuner}"
        # What each process's `search()` would refuse (another config in the project): one line here.
        tuning.check_search(hm, args.tuner, max_trials=int(args.max_trials), directory=directory,
                            project_name=project, overwrite=bool(getattr(args, "overwrite", False)),
                            max_epochs=getattr(args, "max_epochs", None), objective=getattr(args, "objective", None))
        if getattr(args, "overwrite", False):
            shutil.rmtree(Path(directory) / project, ignore_errors=True)
        child = argparse.Namespace(**{**vars(args), "directory": directory, "project_name": project})
        rc = launch.launch_distributed(
            _child_argv(child), workers, host=getattr(args, "oracle_host", None) or "127.0.0.1",
            port=getattr(args, "oracle_port", None), timeout_s=getattr(args, "timeout", None),
        )
        summary = Path(directory) / project / "summary.json"
        if rc == 0 and summary.is_file():
            print(f"distributed search done ({workers} workers): {summary}")
        return int(rc)

    def arg(name, default):  # an option not given (None); a given 0 is not replaced by the default
        v = getattr(args, name, None)
        return default if v is None else v

    try:
        result = tuning.search(
            hm, args.tuner, max_trials=int(args.max_trials), directory=directory,
            project_name=getattr(args, "project_name", None), overwrite=bool(getattr(args, "overwrite", False)),
            objective=getattr(args, "objective", None), max_epochs=getattr(args, "max_epochs", None),
            population_size=int(arg("population_size", 4)), ready_interval=int(arg("ready_interval", 1)),
            seed=arg("seed", 0), top_k=int(arg("top_k", 10)), export=not getattr(args, "no_export", False),
        )
    except tuning.SearchFailedError as e:
        print(f"trainwell tune: {e}", file=sys.stderr)
        return 1
    if has_chief_oracle() and not is_chief_oracle():
        return 0
    if getattr(result, "best_config", None) is not None and hasattr(hm.cfg, "to_dict"):
        changed = {k: v for k, v in result.best_config.to_dict().items() if hm.cfg.to_dict().get(k) != v}
        print(f"The best trial's config: {' '.join(f'--set {k}={override_text(v)}' for k, v in changed.items())}"
              if changed else "The best trial's config is the base config.")
    return 0 if result.best_trial_id is not None else 1


def _hypermodel_from_args(args):
    """The hypermodel of `trainwell tune RECIPE [--config FILE] [--set k=v ...]`.

    RECIPE is a recipe name or `module:factory`; the module's `Config` (if any)
    loads `--config` and `--set` with its types and validation.
    """
    recipe = args.recipe
    if ":" in recipe:
        mod_name, _, attr = recipe.partition(":")
        try:
            module = importlib.import_module(mod_name)
            factory = getattr(module, attr)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"Cannot load the hypermodel factory {recipe!r}: {e}") from None
    else:
        if recipe not in RECIPES:
            raise ConfigError(f"Unknown recipe {recipe!r}. Expected one of: {', '.join(RECIPES)} or 'module:factory'.")
        module = recipes.get(recipe)
        factory = module.hypermodel
    if hasattr(module, "Config"):
        return factory(module.Config.load(getattr(args, "config", None), getattr(args, "set", None) or []))
    overrides = read_config_file(args.config) if getattr(args, "config", None) else {}
    overrides.update(parse_overrides(getattr(args, "set", None) or []))
    return factory(None, **overrides)


def cmd_lr_find(args) -> int:
    module = _recipe_module(args.recipe)
    cfg = _checked_config(module, args.config, args.set)
    return int(lr_find_main(module, cfg, args) or 0)


def cmd_info(args) -> int:

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
    tu.add_argument("--directory", metavar="D", default="tuning",
                    help="parent directory of the search, or an s3:// or gs:// URL")
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
    add_prepare_parser(sub)
    add_input_report_parser(sub)
    add_data_service_parser(sub)

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

