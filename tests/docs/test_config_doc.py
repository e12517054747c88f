"""docs/config.md is what docs/gen_config.py makes from the recipes' Config dataclasses today."""

import importlib.util
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _generator():
    spec = importlib.util.spec_from_file_location("gen_config", DOCS / "gen_config.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_config_reference_is_up_to_date():
    gen = _generator()
    assert (DOCS / "config.md").read_text() == gen.render(), (
        "docs/config.md is out of date: run `.venv/bin/python docs/gen_config.py`")


def test_every_field_of_every_recipe_is_on_the_page_with_its_default_and_source():
    import dataclasses

    from trainwell.recipes import resnet_imagenet, transformer_finetune

    text = (DOCS / "config.md").read_text()
    for cls in (resnet_imagenet.Config, transformer_finetune.Config):
        for f in dataclasses.fields(cls):
            assert f"| `{f.name}` |" in text, f.name
    assert '| `epochs` | `int` | `90` | [Goyal] sec. 5.1, [MG], [NV] |' in text
    assert '| `peak_lr` | `float` | `3e-5` | [BERT] grid {2e-5, 3e-5, 5e-5} |' in text
