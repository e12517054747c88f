import dataclasses
import json
from typing import Literal, Optional

import pytest

from trainwell.config import BaseConfig, ConfigError, check_range, coerce, parse_overrides


@dataclasses.dataclass
class DemoConfig(BaseConfig):
    lr: float = 0.1  # source: a comment like the recipes have
    label_smoothing: float = 0.1
    schedule: Literal["cosine", "step"] = "cosine"
    boundaries: tuple[int, ...] = (30, 60, 80)
    dropout: Optional[float] = None
    use_ema: bool = False

    def validate(self):
        super().validate()
        check_range(self, "label_smoothing", 0.0, 1.0, hi_open=True)


def test_defaults_and_types():
    c = DemoConfig()
    assert c.lr == 0.1 and c.boundaries == (30, 60, 80) and c.dropout is None
    assert DemoConfig(epochs=3.0).epochs == 3  # integral float accepted for an int field


def test_overrides_coerced_from_field_types():
    c = DemoConfig.load(overrides=["lr=0.5", "epochs=7", "use_ema=true", "boundaries=[1, 2]",
                                   "dropout=0.2", "schedule=step", "run_dir=/tmp/x"])
    assert (c.lr, c.epochs, c.use_ema, c.boundaries, c.dropout, c.schedule, c.run_dir) == (
        0.5, 7, True, (1, 2), 0.2, "step", "/tmp/x")
    assert DemoConfig.load(overrides=["dropout=null"]).dropout is None
    assert DemoConfig.load(overrides=["boundaries=5,10"]).boundaries == (5, 10)


def test_yaml_and_json_files(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("epochs: 4\nlr: 0.02\nboundaries: [3, 6]\n")
    c = DemoConfig.load(y, overrides=["epochs=5"])  # overrides win over the file
    assert (c.epochs, c.lr, c.boundaries) == (5, 0.02, (3, 6))
    j = tmp_path / "c.json"
    j.write_text(json.dumps({"seed": 9, "use_ema": True}))
    assert DemoConfig.load(j).seed == 9
    c.save(tmp_path / "saved.yaml")
    assert DemoConfig.load(tmp_path / "saved.yaml") == c
    assert DemoConfig.load(overrides=["lr=1"], base={"epochs": 3}).epochs == 3


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        (["epochs=abc"], r"Invalid value for `epochs`: expected an integer\. Received: epochs='abc'"),
        (["epochs=0"], r"`epochs`: expected a number > 0\. Received: epochs=0"),
        (["lr=fast"], r"`lr`: expected a number\. Received: lr='fast'"),
        (["use_ema=maybe"], r"`use_ema`: expected true or false"),
        (["schedule=linear"], r"`schedule`: expected one of 'cosine', 'step'\. Received: schedule='linear'"),
        (["label_smoothing=1.5"], r"`label_smoothing`: expected a number in \[0.0, 1.0\)"),
        (["precision=fp16"], r"`precision`: expected one of 'auto', 'mixed_float16'"),
        (["strategy=gpu:2"], r"`strategy`: expected one of"),
        (["epoch=3"], r"Unknown config key `epoch` for DemoConfig\. Did you mean `epochs`\?"),
        (["epochs"], r"Invalid override: expected key=value\. Received: 'epochs'"),
        (["boundaries=[1, x]"], r"`boundaries`: expected a list of an integer"),
    ],
)
def test_errors_are_one_line_and_name_the_key(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern) as e:
        DemoConfig.load(overrides=overrides)
    assert "\n" not in str(e.value)


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="Config file not found: '.*nope.yaml'"):
        DemoConfig.load(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("epochs: [1\n")
    with pytest.raises(ConfigError, match="Cannot parse config file") as e:
        DemoConfig.load(bad)
    assert "\n" not in str(e.value)
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        DemoConfig.load(lst)
    txt = tmp_path / "c.toml"
    txt.write_text("x=1")
    with pytest.raises(ConfigError, match="Unsupported config file type"):
        DemoConfig.load(txt)
    unknown = tmp_path / "u.yaml"
    unknown.write_text("epocs: 3\n")
    with pytest.raises(ConfigError, match="Unknown config key `epocs`"):
        DemoConfig.load(unknown)


def test_yaml_is_loaded_safely(tmp_path):
    evil = tmp_path / "evil.yaml"
    evil.write_text("dataset: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(ConfigError, match="Cannot parse config file"):
        DemoConfig.load(evil)


def test_direct_construction_validates():
    with pytest.raises(ConfigError, match="Received: batch_size=-4"):
        DemoConfig(batch_size=-4)
    with pytest.raises(ConfigError, match="Received: epochs=True"):
        DemoConfig(epochs=True)
    with pytest.raises(ConfigError, match="Unknown config key"):
        DemoConfig().replace(nope=1)
    assert DemoConfig().replace(lr=0.3).lr == 0.3


def test_coerce_and_parse_helpers():
    assert coerce("x", "1e-3", float, from_string=True) == 0.001
    assert coerce("x", "1_000", int, from_string=True) == 1000
    assert parse_overrides(["a=b=c"]) == {"a": "b=c"}


def test_literal_of_ints_accepts_their_strings():
    @dataclasses.dataclass
    class V(BaseConfig):
        verbose: Literal["auto", 0, 1, 2] = "auto"

    assert V(verbose=0).verbose == 0
    assert V(verbose="1").verbose == 1  # YAML/JSON strings too
    assert V.load(overrides=["verbose=2"]).verbose == 2
    with pytest.raises(ConfigError, match="Received: verbose=3"):
        V(verbose=3)
