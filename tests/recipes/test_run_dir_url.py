"""A recipe run whose `run_dir` is an object-store URL (a real S3-protocol server, moto, on 127.0.0.1).

Everything the run writes lands under the URL (manifest, config, history, metrics, logs; checkpoints
through the object-store commit protocol), the local staging directory goes at the end, and a
resume from the URL, in Python or with `trainwell resume URL`, reads it back and continues.
"""

from __future__ import annotations

import csv
import io
import json

import pytest

from trainwell import cli, storage
from trainwell.config import ConfigError
from trainwell.recipes import harness
from trainwell.recipes import resnet_imagenet as recipe

TINY = dict(dataset="digits", image_size=8, batch_size=64, width=4, model="resnet18", verbose="0", doctor=False)


def _history_rows(store) -> list[dict]:
    return list(csv.DictReader(io.StringIO(store.get("history.csv").decode())))


def test_a_run_on_a_bucket_writes_there_and_resumes_from_there(s3_bucket, capsys):
    url = f"{s3_bucket}/runs/exp1"
    run = recipe.train(run_dir=url, epochs=1, **TINY)
    store = storage.store_for(url)
    names = store.files()
    for name in ("manifest.json", "config.yaml", "history.csv", "metrics.json", "checkpoints/checkpoint.json"):
        assert name in names, names
    assert any(n.startswith("tensorboard/") for n in names) and any(n.startswith("checkpoints/ckpt-") for n in names)
    assert json.loads(store.get("manifest.json"))["config"]["run_dir"] == url
    assert run.run_dir == url and not harness._URL_RUNS  # the result names the URL; the staging directory is gone
    assert len(_history_rows(store)) == 1
    # resume from the URL with one more epoch: the history there grows, the checkpoint is the next one
    assert cli.main(["resume", url, "--set", "epochs=2"]) == 0
    out = capsys.readouterr()
    assert "secret" not in out.out + out.err  # no credential in any output
    assert f"run directory: {url}" in out.out  # not the staging directory, gone by then
    assert [int(r["epoch"]) for r in _history_rows(store)] == [0, 1]
    assert json.loads(store.get("manifest.json"))["config"]["epochs"] == 2
    assert harness.resume_epoch(harness.checkpoint_dir(url)) == 2


def test_a_missing_bucket_is_one_line_and_writes_nothing(s3_bucket):
    with pytest.raises(ConfigError, match=r"`run_dir`.*no bucket 'no-such-bucket-x'.*Received: run_dir="):
        recipe.train(run_dir="s3://no-such-bucket-x/run", epochs=1, **TINY)
    assert harness._URL_RUNS == {}  # and its staging directory went with it
