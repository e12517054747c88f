"""A search whose `directory` is an object-store URL (a real S3-protocol server, moto, on 127.0.0.1)."""

import json

import pytest

from trainwell import storage, tuning

from .test_tuning import tiny_hypermodel


def test_a_search_on_a_bucket_writes_there_and_continues_from_there(s3_bucket, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # nothing may land in a local "s3:" directory
    url = f"{s3_bucket}/tuning"
    result = tuning.search(tiny_hypermodel(epochs=1), "random", max_trials=2, directory=url, verbose=0, export=False)
    project = f"{url}/{result.tuner.project_name}"
    store = storage.store_for(project)
    names = store.files()
    assert {"oracle.json", "summary.json", "summary.csv", "trials.png"} <= set(names), names
    assert sum(n.endswith("/trial.json") for n in names) == 2
    assert result.project_dir == project and all(v.startswith(project + "/") for v in result.files.values())
    assert json.loads(store.get("summary.json"))["files"] == result.files
    assert f"summary_json={project}/summary.json" in capsys.readouterr().out  # the URL, not the local copy
    assert not any(tmp_path.iterdir())
    # Rerun with one more trial: the two finished ones are read back from the bucket, not run again.
    again = tuning.search(tiny_hypermodel(epochs=1), "random", max_trials=3, directory=url, verbose=0, export=False)
    assert "Reloading Tuner from" in capsys.readouterr().out  # KerasTuner found the oracle the bucket held
    assert len(again.rows) == 3 and {r["trial_id"] for r in result.rows} < {r["trial_id"] for r in again.rows}
    assert sum(n.endswith("/trial.json") for n in store.files()) == 3
    # overwrite=True starts afresh on the bucket too: the old search's trials go.
    tuning.search(tiny_hypermodel(epochs=1), "random", max_trials=1, directory=url, verbose=0, export=False,
                  overwrite=True)
    assert sum(n.endswith("/trial.json") for n in store.files()) == 1


def test_a_search_directory_url_is_checked_before_anything_runs(s3_bucket):
    with pytest.raises(ValueError, match=r"`directory`.*no bucket 'no-such-bucket-y'.*Received: directory="):
        tuning.search(tiny_hypermodel(epochs=1), "random", max_trials=1, directory="s3://no-such-bucket-y/t")
    with pytest.raises(ValueError, match=r"`directory`.*without credentials.*Received: directory='s3://\*\*\*@"):
        tuning.search(tiny_hypermodel(epochs=1), "random", max_trials=1, directory="s3://key:secret@b/t")
