"""YAML config -> frozen dataclasses, validated with path-named errors."""

from recflow.config.convert import from_dict, to_dict
from recflow.config.loader import config_from_dict, dump_config, load_config
from recflow.config.schema import (
    CategoricalFeature,
    Config,
    Feature,
    MultiHotFeature,
    NumericFeature,
    SequenceFeature,
    SparseFeature,
    TableConfig,
)

__all__ = [
    "CategoricalFeature",
    "Config",
    "Feature",
    "MultiHotFeature",
    "NumericFeature",
    "SequenceFeature",
    "SparseFeature",
    "TableConfig",
    "config_from_dict",
    "dump_config",
    "from_dict",
    "load_config",
    "to_dict",
]
