"""The command line's bad-input table: each bad input is one line on stderr, exit status 2, no run directory.

Most cases fail when the config is built, so `--dry-run` catches them and no TensorFlow op
runs; they go through `cli.main` in this process. `test_cli.py` checks a few of them
through the console script (exit status and the whole of stderr).
"""

from __future__ import annotations

import json
import os

import pytest

from trainwell import cli

R, T = "resnet-imagenet", "transformer-finetune"
# A PNG signature and end chunk: what the folder check reads (it does not decode).
PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 32 + b"IEND\xaeB`\x82"


def _write(path, data: bytes | str) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)
    return str(path)


@pytest.fixture(scope="module")
def bad(tmp_path_factory):
    """Bad inputs on disk, by name."""
    d = tmp_path_factory.mktemp("bad")
    rows = "".join(f"review {i},{'pos' if i % 2 else 'neg'}\n" for i in range(20))
    f = {
        "a_file": _write(d / "a_file", "not a directory"),
        "empty_csv": _write(d / "empty.csv", ""),
        "header_only_csv": _write(d / "header.csv", "text,label\n"),
        "no_label_csv": _write(d / "nolabel.csv", "text,stars\n" + rows),
        "one_class_csv": _write(d / "oneclass.csv", "text,label\n" + "".join(f"r {i},pos\n" for i in range(20))),
        "latin1_csv": _write(d / "latin1.csv", ("text,label\n" + rows + "caf\xe9 cr\xe8me,pos\n").encode("latin-1")),
        "bad_jsonl": _write(d / "bad.jsonl", '{"text": "a", "label": 0}\n{"text": "b", "label": \n'),
        "list_label_jsonl": _write(d / "list.jsonl", "".join(
            json.dumps({"text": f"t{i}", "label": [i % 2]}) + "\n" for i in range(10))),
        "latin1_yaml": _write(d / "latin1.yaml", "dataset: caf\xe9\n".encode("latin-1")),
        "deep_yaml": _write(d / "deep.yaml", "epochs: " + "[" * 3000 + "]" * 3000 + "\n"),
        "dup_yaml": _write(d / "dup.yaml", "epochs: 3\nbatch_size: 8\nepochs: 5\n"),
        "preset_no_config": str(d / "preset_dir"),
    }
    os.makedirs(f["preset_no_config"])
    one = d / "one_class"
    for i in range(3):
        _write(one / "cat" / f"{i}.png", PNG)
    (one / "dog").mkdir()  # a class folder without images is no class
    f["one_class_folder"] = str(one)
    corrupt = d / "all_corrupt"
    for c in ("cat", "dog"):
        _write(corrupt / c / "0.jpg", b"<html>404</html>")
        _write(corrupt / c / "1.png", PNG[:20])  # truncated: no IEND
    f["corrupt_folder"] = str(corrupt)
    f["empty_folder"] = str(d / "empty_folder")
    os.makedirs(f["empty_folder"])
    return f


def _train(recipe, *sets):
    return ["train", recipe, "--dry-run", *[a for s in sets for a in ("--set", s)]]


# (id, argv builder, what the one line must say). `{name}` is a path from the `bad` fixture.
CASES = [
    # -- names, with "did you mean"
    ("unknown recipe", ["train", "resnet-imagnet"], "Did you mean 'resnet-imagenet'?"),
    ("unknown dataset", _train(R, "dataset=nosuch"), "Received: dataset='nosuch'"),
    ("dataset typo", _train(R, "dataset=mnist"), "Did you mean 'mnist5k' or 'tfds:mnist'?"),
    ("text dataset typo", _train(T, "dataset=rotten-tomatoes"), "Did you mean 'rotten_tomatoes'?"),
    ("source kind typo", _train(R, "dataset=foldr:/data"), "Did you mean 'folder:/data'?"),
    ("unknown TFDS name", _train(R, "dataset=tfds:mnsit"), "Did you mean 'tfds:mnist'"),
    ("TFDS not prepared", _train(R, "dataset=tfds:mnist", "data_dir={empty_folder}"), "is not prepared"),
    ("preset typo", _train(T, "preset=minilmm"), "Did you mean 'minilm'?"),
    ("augment typo", _train(R, "dataset=digits", "augment=bogus"), "Received: augment='bogus'"),
    ("strategy typo", _train(R, "dataset=digits", "strategy=mirored"), "Did you mean 'mirrored'?"),
    ("unknown key", _train(R, "dataset=digits", "epoch=3"), "Did you mean `epochs`?"),
    # -- paths
    ("missing folder", _train(R, "dataset=folder:/nonexistent/images"), "Image folder '/nonexistent/images' not found"),
    ("missing TFRecords", _train(R, "dataset=tfrecord:/nonexistent/train-*"), "no directory '/nonexistent'"),
    ("missing CSV", _train(T, "dataset=csv:/nonexistent/reviews.csv"), "no file or directory"),
    ("missing preset dir", _train(T, "preset=/nonexistent/preset"), "preset directory '/nonexistent/preset' not found"),
    ("not a preset dir", _train(T, "preset={preset_no_config}"), "no config.json"),
    ("run_dir is a file", _train(R, "dataset=digits", "run_dir={a_file}"), "is a file; expected a directory"),
    ("run_dir under a file", _train(R, "dataset=digits", "run_dir={a_file}/run"), "which is a file"),
    ("missing config file", ["train", R, "--config", "/nonexistent.yaml"], "Config file not found"),
    ("config is a directory", ["train", R, "--config", "{empty_folder}"], "is a directory; expected a .yaml"),
    ("data_dir is a file", _train(R, "dataset=tfds:mnist", "data_dir={a_file}"), "is a file; expected a directory"),
    ("text data_dir is a file", _train(T, "data_dir={a_file}"), "is a file; expected a directory"),
    ("resume a file", ["resume", "{a_file}", "--dry-run"], "is a file; expected the run's directory"),
    # -- URLs: run_dir and tune's directory may be one (#33), checked before anything runs; data_dir not yet
    ("run_dir URL with credentials", _train(R, "dataset=digits", "run_dir=s3://KEY:SECRET@bucket/run"),
     "Invalid value for `run_dir`: expected a URL without credentials"),
    ("run_dir URL of an unknown scheme", _train(R, "dataset=digits", "run_dir=ftp://host/run"),
     "scheme 'ftp' is not supported"),
    ("run_dir URL without a bucket", _train(R, "dataset=digits", "run_dir=s3:///run"), "URL naming a bucket"),
    ("data_dir is a URL", _train(T, "data_dir=gs://bucket/data"), "Invalid value for `data_dir`: a URL"),
    ("resume a URL with credentials", ["resume", "s3://KEY:SECRET@bucket/run", "--dry-run"],
     "Invalid value for `RUN_DIR`: expected a URL without credentials"),
    ("tune objective typo", ["tune", R, "--objective", "val_acuracy", "--dry-run", "--set", "dataset=digits"],
     "Did you mean 'val_accuracy'"),
    ("tune directory URL with credentials",
     ["tune", R, "--directory", "s3://KEY:SECRET@bucket/t", "--dry-run", "--set", "dataset=digits"],
     "Invalid value for `--directory`: expected a URL without credentials"),
    ("TFRecords on a file system TensorFlow lacks", _train(R, "dataset=tfrecord:s3://bucket/data/train-*"),
     "s3:// is not one of TensorFlow's file systems"),
    ("image folder on a URL", _train(R, "dataset=folder:s3://bucket/images"),
     "a class folder is not read from an object store"),
    ("prepare-images into a URL", ["prepare-images", "digits", "s3://bucket/prepared"],
     "Invalid value for argument `dst`. Expected a local folder"),
    ("prepare-images into a file", ["prepare-images", "digits", "{a_file}"], "'{a_file}' is a file; expected a directory"),
    ("tune directory is a file", ["tune", R, "--directory", "{a_file}", "--dry-run", "--set", "dataset=digits"],
     "Invalid value for `--directory`: '{a_file}' is a file; expected a directory"),
    ("tune directory under a file", ["tune", R, "--directory", "{a_file}/d", "--dry-run", "--set", "dataset=digits"],
     "which is a file"),
    # -- data that cannot be trained on
    ("empty CSV", _train(T, "dataset=csv:{empty_csv}"), "Empty file"),
    ("header-only CSV", _train(T, "dataset=csv:{header_only_csv}"), "has no rows"),
    ("missing label column", _train(T, "dataset=csv:{no_label_csv}"), "Label field 'label' not found"),
    ("one-class CSV", _train(T, "dataset=csv:{one_class_csv}"), "only one class ('pos', 20 examples)"),
    ("Latin-1 CSV", _train(T, "dataset=csv:{latin1_csv}"), "is not UTF-8 text (byte 0xe9 on line 22)"),
    ("bad JSONL line", _train(T, "dataset=jsonl:{bad_jsonl}"), "Invalid JSON on line 2"),
    ("list labels", _train(T, "dataset=jsonl:{list_label_jsonl}"), "is not a single value: [0]"),
    ("empty image folder", _train(R, "dataset=folder:{empty_folder}"), "no class subfolders with"),
    ("one-class folder", _train(R, "dataset=folder:{one_class_folder}"), "only 1 class ('cat', 3 images)"),
    ("all images corrupt", _train(R, "dataset=folder:{corrupt_folder}"), "all 4 images"),
    # -- numbers
    ("NaN base_lr", _train(R, "dataset=digits", "base_lr=nan"), "expected a finite number"),
    ("inf warmup", _train(R, "dataset=digits", "warmup_epochs=inf"), "expected a finite number"),
    ("NaN min_lr", _train(R, "dataset=digits", "min_lr=nan"), "Received: min_lr='nan'"),
    ("inf weight decay", _train(R, "dataset=digits", "weight_decay=inf"), "Received: weight_decay='inf'"),
    ("seed 2**70", _train(R, "dataset=digits", f"seed={2**70}"), "expected an integer in [0, 4294967295]"),
    ("min_lr above peak", _train(R, "dataset=digits", "batch_size=256", "min_lr=0.5"), "at most the peak LR 0.1"),
    ("warmup = the run", _train(R, "dataset=digits", "epochs=1", "warmup_epochs=1"), "fewer than epochs=1"),
    ("transformer NaN LR", _train(T, "peak_lr=nan"), "Received: peak_lr='nan'"),
    ("image_size below the stride", _train(R, "dataset=digits", "image_size=1"),
     "expected at least 8 px, the network's total stride with the small-image stem"),
    ("image_size below ImageNet's stride", _train(R, "dataset=digits", "small_stem=false", "image_size=16"),
     "expected at least 32 px"),
    ("derived peak_lr", _train(R, "dataset=digits", "peak_lr=0.2"), "is derived from other fields (Peak LR after "
     "warmup: base_lr x batch_size / lr_base_batch [Goyal]), not set. Did you mean `base_lr`?"),
    # -- config files
    ("Latin-1 config", ["train", R, "--config", "{latin1_yaml}"], "is not UTF-8 text (byte 0xe9 at offset 12)"),
    ("3000-deep YAML", ["train", R, "--config", "{deep_yaml}"], "exceeded maximum nesting depth (line 1, column 1008)"),
    ("duplicate YAML key", ["train", R, "--config", "{dup_yaml}"], "duplicate key 'epochs' (first given on line 1)"),
]


def _fill(argv, files):
    return [a.format(**files) for a in argv]


@pytest.mark.parametrize("argv, says", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_and_no_run_directory(argv, says, bad, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(_fill(argv, bad)) == 2
    out, err = capsys.readouterr()
    assert err.startswith("trainwell: error: ") and err.count("\n") == 1, err
    assert says.format(**bad) in err, err
    assert out == "" and list(tmp_path.iterdir()) == []  # nothing printed, nothing made


def test_the_good_twins_of_the_bad_inputs_pass(bad, tmp_path, monkeypatch, capsys):
    # The checks reject what is wrong, not everything near it: a default (not explicit)
    # warmup longer than a 1-epoch run is the recipe's to fit, a min_lr at the peak is fine.
    monkeypatch.chdir(tmp_path)
    ok = [
        _train(R, "dataset=digits", "epochs=1"),
        _train(R, "dataset=digits", "batch_size=256", "min_lr=0.1", f"seed={2**32 - 1}"),
        _train(T, "dataset=rotten_tomatoes", "preset=minilm"),
    ]
    for argv in ok:
        assert cli.main(argv) == 0, capsys.readouterr().err
    capsys.readouterr()


def test_a_config_is_checked_and_its_derived_values_computed_without_loading_keras(python_subprocess):
    # A typo on the command line is answered in about a second: loading Keras and TensorFlow
    # (about 10 s of CPU) waits until something trains.
    r = python_subprocess(
        """
        import sys
        from trainwell.config import ConfigError
        from trainwell.recipes import resnet_imagenet
        try:
            resnet_imagenet.Config(dataset="mnistt")
        except ConfigError as e:
            print("REFUSED", e)
        print("PEAK", resnet_imagenet.Config(dataset="digits", base_lr=0.1, batch_size=512).peak_lr)
        print("LOADED", sorted(m for m in ("keras", "tensorflow", "jax") if m in sys.modules))
        """
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "REFUSED" in r.stdout and "Did you mean 'mnist5k'?" in r.stdout
    assert "PEAK 0.2" in r.stdout  # the linear scaling rule: 0.1 x 512 / 256
    assert "LOADED []" in r.stdout, r.stdout


# -- paths that fail for root too: /proc refuses new entries; a read-only file system and an
#    unreadable file are simulated (tests run as root, whom permission bits do not stop).

needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")


def _one_line(err: str, says: str) -> None:
    assert err.startswith("trainwell: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert says in err, err


@needs_proc
def test_a_run_dir_that_cannot_be_made_is_one_line_exit_2_and_nothing_left(tmp_path, monkeypatch, capsys):
    # `--set run_dir=/proc/...`: a 31-line FileNotFoundError traceback and exit 1 before.
    monkeypatch.chdir(tmp_path)
    argv = ["train", R, "--set", "dataset=digits", "--set", "model=resnet18", "--set", "width=4",
            "--set", "run_dir=/proc/trainwell-run/a"]
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    _one_line(err, "Invalid value for `run_dir`: cannot use '/proc/trainwell-run/a' as the run directory: "
                   "'/proc' does not accept new entries. Received: run_dir='/proc/trainwell-run/a'")
    assert list(tmp_path.iterdir()) == [] and not os.path.exists("/proc/trainwell-run")


@needs_proc
def test_lr_find_checks_its_output_directory_before_it_runs(tmp_path, monkeypatch, capsys):
    from trainwell.recipes import resnet_imagenet

    def never(cfg):  # the range test must not start
        raise AssertionError("lr_find_setup ran")

    monkeypatch.setattr(resnet_imagenet, "lr_find_setup", never)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["lr-find", R, "--set", "dataset=digits", "--set", "run_dir=/proc/trainwell-lr"]) == 2
    _one_line(capsys.readouterr().err, "cannot use '/proc/trainwell-lr' as the run directory")
    assert list(tmp_path.iterdir()) == []


def test_a_read_only_location_is_refused_before_anything_runs(tmp_path, monkeypatch, capsys):
    # What `os.access` says on a read-only mount (even for root), and `statvfs`'s read-only flag.
    ro = tmp_path / "ro"
    ro.mkdir()
    real_access, real_statvfs = os.access, os.statvfs
    monkeypatch.setattr(os, "access", lambda p, mode, **k: False if str(p).startswith(str(ro)) and mode & os.W_OK
                        else real_access(p, mode, **k))

    class _Flags:
        def __init__(self, st):
            self.f_flag = st.f_flag | (os.ST_RDONLY if self._ro else 0)

    def statvfs(p):
        _Flags._ro = str(p).startswith(str(ro))
        return _Flags(real_statvfs(p))

    monkeypatch.setattr(os, "statvfs", statvfs)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    cases = [
        (_train(R, "dataset=digits", f"run_dir={ro}/run"),
         f"Invalid value for `run_dir`: '{ro}/run' cannot be written (its nearest existing parent '{ro}'): "
         "read-only file system."),
        (_train(R, "dataset=digits", f"run_dir={ro}"), f"'{ro}' cannot be written: read-only file system."),
        (["tune", R, "--directory", str(ro / "search"), "--dry-run", "--set", "dataset=digits"],
         "Invalid value for `--directory`"),
    ]
    (ro / "c.yaml").write_text("epochs: 2\n")
    cases.append((["lr-find", R, "--config", str(ro / "c.yaml"), "--write", "--set", "dataset=digits"],
                  f"`--write` cannot rewrite '{ro}/c.yaml': its directory '{ro}' is not writable"))
    for argv, says in cases:
        assert cli.main(argv) == 2
        _one_line(capsys.readouterr().err, says)
    assert sorted(p.name for p in ro.iterdir()) == ["c.yaml"] and list(work.iterdir()) == []


def test_make_run_dir_removes_the_parents_it_made_when_the_directory_cannot_be_written(tmp_path, monkeypatch):
    import tempfile

    from trainwell import rundir
    from trainwell.config import ConfigError

    def read_only(*a, **k):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    with pytest.raises(ConfigError, match=r"^Invalid value for `run_dir`: cannot use '.*/a/b/run' as the run "
                                          r"directory: read-only file system\. Received: run_dir="):
        rundir.make_run_dir(tmp_path / "a" / "b" / "run")
    assert list(tmp_path.iterdir()) == []  # a, a/b and a/b/run were made, then removed
    (tmp_path / "kept").mkdir()
    with pytest.raises(ConfigError, match="read-only file system"):
        rundir.make_run_dir(tmp_path / "kept")
    assert (tmp_path / "kept").is_dir()  # it existed before: left as it was


def test_unreadable_config_file_and_manifest_are_one_line(tmp_path, monkeypatch, capsys):
    from pathlib import Path

    config = tmp_path / "c.yaml"
    config.write_text("epochs: 2\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / "manifest.json").write_text('{"recipe": "resnet-imagenet"}')
    real = Path.read_bytes

    def read_bytes(self):
        if self in (config, run / "manifest.json"):
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    assert cli.main(["train", R, "--config", str(config), "--dry-run"]) == 2
    _one_line(capsys.readouterr().err, f"Cannot read config file '{config}': permission denied.")
    assert cli.main(["resume", str(run), "--dry-run"]) == 2
    _one_line(capsys.readouterr().err, f"Cannot read '{run / 'manifest.json'}': permission denied.")
