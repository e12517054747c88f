import dataclasses
import json
from typing import Literal, Optional

import pytest

from trainwell.config import BaseConfig, ConfigError, check_range, coerce, parse_overrides, read_config_file


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


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN", "1e999"])
def test_non_finite_numbers_are_refused(value):
    with pytest.raises(ConfigError, match=rf"`lr`: expected a finite number\. Received: lr='{value}'"):
        DemoConfig.load(overrides=[f"lr={value}"])
    with pytest.raises(ConfigError, match="expected a finite number"):
        DemoConfig(lr=float(value))
    with pytest.raises(ConfigError, match="expected a finite number"):
        DemoConfig(lr=10**400)  # an int beyond the float range


def test_check_positive_and_range_refuse_nan_directly():
    # A value that bypassed coercion (a dataclass field typed Any, a subclass) is still checked.
    from trainwell.config import check_positive

    with pytest.raises(ConfigError, match="expected a number > 0"):
        check_positive(type("C", (), {"x": float("nan")})(), "x")
    with pytest.raises(ConfigError, match=r"expected a number in \[0.0, 1.0\]"):
        check_range(type("C", (), {"x": float("nan")})(), "x", 0.0, 1.0)


def test_seed_must_fit_numpys_32_bits():
    assert DemoConfig(seed=2**32 - 1).seed == 2**32 - 1
    with pytest.raises(ConfigError, match=r"`seed`: expected an integer in \[0, 4294967295\]"):
        DemoConfig.load(overrides=[f"seed={2**70}"])
    with pytest.raises(ConfigError, match="Received: seed=-1"):
        DemoConfig(seed=-1)


def test_run_dir_that_cannot_be_a_directory(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    assert DemoConfig(run_dir=str(tmp_path / "new" / "run")).run_dir  # not created, just allowed
    assert not (tmp_path / "new").exists()
    with pytest.raises(ConfigError, match="is a file; expected a directory"):
        DemoConfig(run_dir=str(f))
    with pytest.raises(ConfigError, match="which is a file"):
        DemoConfig(run_dir=str(f / "run"))


def test_config_file_encoding_depth_and_duplicate_keys(tmp_path):
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("dataset: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"is not UTF-8 text \(byte 0xe9 at offset 12\); save it as UTF-8"):
        DemoConfig.load(latin)
    bom = tmp_path / "bom.yaml"
    bom.write_bytes("\ufeffepochs: 4\n".encode("utf-8"))
    assert DemoConfig.load(bom).epochs == 4  # a UTF-8 byte-order mark is fine
    deep = tmp_path / "deep.yaml"
    deep.write_text("boundaries: " + "[" * 3000 + "]" * 3000 + "\n")
    with pytest.raises(ConfigError, match="nested too deeply|exceeded maximum nesting depth"):
        DemoConfig.load(deep)
    deep_json = tmp_path / "deep.json"
    deep_json.write_text('{"boundaries": ' + "[" * 3000 + "]" * 3000 + "}")
    with pytest.raises(ConfigError, match="nested too deeply"):
        DemoConfig.load(deep_json)
    dup = tmp_path / "dup.yaml"
    dup.write_text("epochs: 3\nlr: 0.1\nepochs: 5\n")
    with pytest.raises(ConfigError, match=r"duplicate key 'epochs' \(first given on line 1\) \(line 3, column 1\)"):
        DemoConfig.load(dup)
    nested = tmp_path / "nested.yaml"
    nested.write_text("a: {x: 1, x: 2}\n")
    with pytest.raises(ConfigError, match="duplicate key 'x'"):
        read_config_file(nested)
    merge = tmp_path / "merge.yaml"  # YAML merge keys are not duplicates
    merge.write_text("base: &b {x: 1}\nother:\n  <<: *b\n  y: 2\n")
    assert read_config_file(merge)["other"] == {"x": 1, "y": 2}


def test_did_you_mean_for_choices_and_strategy():
    with pytest.raises(ConfigError, match=r"Did you mean 'mirrored'\? Received: strategy='mirored'"):
        DemoConfig(strategy="mirored")
    with pytest.raises(ConfigError, match=r"Did you mean 'mixed_float16' or 'mixed_bfloat16'\? Received: precision='mixed_foat16'"):
        DemoConfig(precision="mixed_foat16")
    with pytest.raises(ConfigError, match=r"Unknown config key `1` for DemoConfig\."):
        DemoConfig.from_dict({1: 2})
