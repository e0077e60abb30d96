"""Checks a one-column CSV's sources the way `recflow data check` does and fails if
that imported TensorFlow.

Usage: python check_sources_without_tensorflow.py CSV_PATH
"""

import sys

from recflow.config import config_from_dict
from recflow.data import check_sources

config = {
    "data": {"train": sys.argv[1], "label": "click"},
    "features": [{"name": "user", "kind": "categorical"}],
}
check_sources(config_from_dict(config))
assert "tensorflow" not in sys.modules, "tensorflow imported"
