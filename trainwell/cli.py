"""The `trainwell` command line.

    trainwell train RECIPE [--config FILE] [--set key=value ...]
    trainwell resume RUN_DIR [--set key=value ...]
    trainwell tune RECIPE --tuner {random,bayesian,hyperband,pbt} ...
    trainwell lr-find RECIPE [--config FILE] [--set key=value ...]
    trainwell info

Exit status: 0 success; 1 the run failed (the error is printed); 2 a bad
command line, config value, key or file (a one-line message, no traceback);
3 the subcommand or recipe is not built yet; 143 the run was preempted by
SIGTERM after writing a checkpoint (resume it with `trainwell resume RUN_DIR`).

`train ... --workers N` / `resume ... --workers N` run N local worker processes
(`trainwell.launch`); the exit status is then the job's: 0, 143 when preempted,
else the status of the first worker that failed (128 + S for a signal S).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
from pathlib import Path

from trainwell.config import ConfigError

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NOT_BUILT = 0, 1, 2, 3


class NotBuiltError(RuntimeError):
    """A subcommand or recipe that is not built yet."""


def _recipe_module(name: str):
    from trainwell.recipes import RECIPES

    if name not in RECIPES:
        raise ConfigError(f"Unknown recipe {name!r}. Expected one of: {', '.join(RECIPES)}.")
    mod = f"trainwell.recipes.{RECIPES[name]}"
    if importlib.util.find_spec(mod) is None:
        raise NotBuiltError(f"the recipe {name!r} is not built yet in this version of trainwell.")
    return importlib.import_module(mod)


def _print_result(run) -> None:
    print()
    print("Run finished.")
    for k, v in (run.metrics or {}).items():
        print(f"  {k}: {v:.4f}" if isinstance(v, float) else f"  {k}: {v}")
    print(f"  run directory: {run.run_dir}")
    plots = sorted(str(p) for p in Path(run.run_dir).glob("*.png"))
    if plots:
        print("  plots: " + ", ".join(plots))


def _workers(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1. Received: workers={value!r}")
    return n


def _launch_workers(args, argv: list[str]) -> int:
    """Runs `argv` (a `trainwell` command) as `args.workers` local workers; see `trainwell.launch`."""
    from trainwell import launch

    argv = list(argv)
    for s in args.set:
        argv += ["--set", s]
    return launch.launch(launch.worker_command(argv), args.workers)


def cmd_train(args) -> int:
    module = _recipe_module(args.recipe)
    cfg = module.Config.load(args.config, args.set)
    if args.dry_run:
        print(json.dumps(cfg.to_dict(), indent=2))
        return EXIT_OK
    if getattr(args, "workers", None):
        from trainwell import runtime

        # One run directory for every worker: named here, passed to all.
        run_dir = runtime.make_run_dir(cfg.run_dir, prefix=args.recipe)
        argv = ["train", args.recipe] + (["--config", args.config] if args.config else [])
        args.set = list(args.set) + [f"run_dir={run_dir}"]
        return _launch_workers(args, argv)
    _print_result(module.train(cfg))
    return EXIT_OK


def cmd_resume(args) -> int:
    run_dir = Path(args.run_dir)
    manifest_path = run_dir / "manifest.json"
    if not manifest_path.is_file():
        raise ConfigError(f"Not a trainwell run directory (no manifest.json): {str(run_dir)!r}")
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"Cannot parse {str(manifest_path)!r}: {e}") from None
    from trainwell.recipes import RECIPES

    recipe = manifest.get("recipe")
    if recipe not in RECIPES:
        raise ConfigError(f"The manifest in {str(run_dir)!r} names no known recipe. Received: recipe={recipe!r}")
    module = _recipe_module(recipe)
    base = dict(manifest.get("config") or {})
    base["run_dir"] = str(run_dir)
    cfg = module.Config.load(overrides=args.set, base=base)
    if args.dry_run:
        print(json.dumps(cfg.to_dict(), indent=2))
        return EXIT_OK
    if getattr(args, "workers", None):
        return _launch_workers(args, ["resume", str(run_dir)])
    _print_result(module.train(cfg))
    return EXIT_OK


def cmd_tune(args) -> int:
    if importlib.util.find_spec("trainwell.tuning") is None:
        raise NotBuiltError("`trainwell tune` (hyperparameter search) is not built yet in this version of trainwell.")
    tuning = importlib.import_module("trainwell.tuning")
    return int(tuning.main(args) or 0)


def cmd_lr_find(args) -> int:
    if importlib.util.find_spec("trainwell.callbacks.lr_finder") is None:
        raise NotBuiltError("`trainwell lr-find` (the LR range test) is not built yet in this version of trainwell.")
    module = _recipe_module(args.recipe)
    lr_finder = importlib.import_module("trainwell.callbacks.lr_finder")
    cfg = module.Config.load(args.config, args.set)
    return int(lr_finder.cli_main(module, cfg, args) or 0)


def cmd_info(args) -> int:
    from trainwell import runtime
    from trainwell.data import embedded

    info = {"versions": runtime.package_versions()}
    try:
        info["devices"] = [f"{d['type']} {d['name']}" for d in runtime.device_summary()]
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

    info["recipes"] = {
        name: ("available" if importlib.util.find_spec(f"trainwell.recipes.{mod}") else "not built yet")
        for name, mod in RECIPES.items()
    }
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
    t.add_argument("--workers", type=_workers, metavar="N",
                   help="run N local MultiWorkerMirroredStrategy workers on 127.0.0.1 (see trainwell.launch)")
    t.set_defaults(func=cmd_train)

    r = sub.add_parser("resume", help="resume a run from its directory")
    r.add_argument("run_dir", metavar="RUN_DIR")
    r.add_argument("--set", metavar="KEY=VALUE", action="append", default=[], help="override a config value")
    r.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
    r.add_argument("--workers", type=_workers, metavar="N", help="resume with N local workers (see trainwell.launch)")
    r.set_defaults(func=cmd_resume)

    tu = sub.add_parser("tune", help="hyperparameter search with KerasTuner")
    tu.add_argument("recipe", metavar="RECIPE", help=f"one of: {', '.join(RECIPES)}, or module:factory")
    tu.add_argument("--tuner", choices=["random", "bayesian", "hyperband", "pbt"], default="random")
    tu.add_argument("--max-trials", type=int, default=10, help="trials of random/bayesian search")
    tu.add_argument("--workers", type=int, default=0,
                    help="run KerasTuner's chief + N workers on this machine (gRPC, no authentication)")
    tu.add_argument("--directory", metavar="D", default="tuning", help="parent directory of the search")
    tu.add_argument("--project-name", help="subdirectory of the search (default: RECIPE-TUNER)")
    tu.add_argument("--overwrite", action="store_true", help="start afresh instead of continuing")
    tu.add_argument("--max-epochs", type=int, help="epochs per model for hyperband and pbt")
    tu.add_argument("--population-size", type=int, help="pbt population (default 4)")
    tu.add_argument("--ready-interval", type=int, help="pbt epochs between exploit/explore (default 1)")
    tu.add_argument("--objective", help="metric to optimise (default: the recipe's, val_accuracy)")
    tu.add_argument("--seed", type=int, help="oracle seed (default 0)")
    tu.add_argument("--top-k", type=int, help="rows of the printed summary (default 10)")
    tu.add_argument("--no-export", action="store_true", help="do not export the best model")
    tu.add_argument("--oracle-host", default="127.0.0.1", help="address of the chief oracle with --workers")
    tu.add_argument("--oracle-port", type=int, help="its port (default: a free one)")
    tu.add_argument("--timeout", type=float, help="seconds before a --workers search is stopped")
    add_config_args(tu)
    tu.set_defaults(func=cmd_tune)

    lf = sub.add_parser("lr-find", help="run the LR range test on a recipe")
    lf.add_argument("recipe", metavar="RECIPE")
    lf.add_argument("--write", action="store_true", help="write the suggestion into the config file")
    lf.add_argument("--method", choices=("probe", "peak", "minimum", "steep", "valley"),
                    help="which suggestion (default probe: short warmup + cosine runs around the range test's "
                         "loss minimum, the best of which gives the schedule's peak LR)")
    lf.add_argument("--probe-steps", type=int, metavar="N",
                    help="steps of each probe run (default: the range test's 100); longer is closer to a full run")
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
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"trainwell: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except NotBuiltError as e:
        print(f"trainwell {args.command}: {e}", file=sys.stderr)
        return EXIT_NOT_BUILT
    except KeyboardInterrupt:
        print("trainwell: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
