"""`trainwell input-report`: the ResNet recipe's input pipeline measured stage by stage, on tiny data."""

import json

import numpy as np
import pytest

from trainwell import cli
from trainwell.cli.input_report import STAGES, format_report


@pytest.fixture(scope="module")
def photos(tmp_path_factory, photo_folder):
    """12 JPEGs of 40-60 px in 2 classes and one corrupt file (the report must not stop on it)."""
    root = photo_folder(tmp_path_factory.mktemp("photos"), 12, (40, 60))
    (root / "c0" / "broken.jpg").write_bytes(b"\xff\xd8 truncated")
    return root


def test_cli_reports_each_stage_of_the_recipe_pipeline(photos, capsys):
    code = cli.main(["input-report", "resnet-imagenet", "--set", f"dataset=folder:{photos}", "--set", "image_size=32",
                     "--set", "batch_size=4", "--set", "augment=inception", "--set", "val_fraction=0",
                     "--seconds", "1", "--target", "7000", "--json", "--quiet"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["dataset"] == f"folder:{photos}" and report["augment"] == "inception"
    assert [s["stage"] for s in report["stages"]] == list(STAGES)
    for s in report["stages"]:
        assert s["images"] > 0 and s["images_per_s"] > 0 and s["images_per_cpu_s"] > 0
        # images per CPU-second and CPU ms per image are the same measurement, inverted
        assert s["cpu_ms_per_image"] == pytest.approx(1e3 / s["images_per_cpu_s"], rel=0.01)
    added = [s["added_cpu_ms_per_image"] for s in report["stages"]]
    assert report["slowest_stage"] == STAGES[int(np.argmax(added))]
    assert sum(added) == pytest.approx(report["stages"][-1]["cpu_ms_per_image"], abs=0.01)
    # to a tenth of a core, as printed (rel=0.01 failed on a CI run where 2.939 cores printed as 2.9)
    assert report["cores_for_target"] == round(7000 / report["images_per_cpu_s"], 1)
    text = format_report(report)
    assert f"slowest stage: {report['slowest_stage']}" in text and "cores to feed 7000 images/s" in text


@pytest.mark.parametrize("argv, received", [
    (["transformer-finetune"], "Received: RECIPE='transformer-finetune'"),
    (["resnet-imagenet", "--set", "dataset=digits", "--seconds", "0"], "Received: seconds=0"),
    (["resnet-imagenet", "--set", "dataset=digits", "--target", "-5"], "Received: target=-5"),
])
def test_cli_bad_input_is_one_line_and_exit_2(argv, received, capsys):
    assert cli.main(["input-report", *argv, "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and received in err[0], err
