"""Imports TensorFlow the way the CLI does (`recflow.cli.import_tensorflow`) and prints, as
JSON, which of the modules it keeps out were loaded; then that pandas still imports on
demand and that `tf.lite` (which imports `distutils.spawn`) is there."""

import json
import sys

from recflow.cli import import_tensorflow

import_tensorflow()
import tensorflow as tf  # noqa: E402

loaded = {name: name in sys.modules for name in ("pandas", "setuptools", "pkg_resources")}
import pandas  # noqa: E402,F401

loaded["tf.lite"] = callable(tf.lite.TFLiteConverter.from_concrete_functions)
print(json.dumps(loaded))
