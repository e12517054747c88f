"""Data loading: embedded datasets (offline), and the recipes' input pipelines."""

from trainwell.data.embedded import (
    EMBEDDED_DATASETS,
    EMBEDDED_MODELS,
    MissingDataError,
    Splits,
    available,
    embedded_path,
    load,
    load_digits,
    load_mnist5k,
    load_rotten_tomatoes,
    minilm_preset_dir,
    stratified_split,
)
from trainwell.data.base import DataError, DataNotFoundError

__all__ = [
    "DataError",
    "DataNotFoundError",
    "EMBEDDED_DATASETS",
    "EMBEDDED_MODELS",
    "MissingDataError",
    "Splits",
    "available",
    "embedded_path",
    "load",
    "load_digits",
    "load_mnist5k",
    "load_rotten_tomatoes",
    "minilm_preset_dir",
    "stratified_split",
]
