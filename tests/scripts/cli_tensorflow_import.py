"""Imports TensorFlow the way the CLI does (`recflow.cli.import_tensorflow`) and prints, as
JSON, which of the modules it keeps out were loaded; then that pandas still imports on
demand, that `tf.lite` (which imports `distutils.spawn`) is there, and how it leaves Python's
garbage collector: on, with TensorFlow's objects frozen out of its view, still collecting."""

import gc
import json
import sys

from recflow.cli import import_tensorflow

import_tensorflow()
import tensorflow as tf  # noqa: E402

loaded = {name: name in sys.modules for name in ("pandas", "setuptools", "pkg_resources")}
import pandas  # noqa: E402,F401

loaded["tf.lite"] = callable(tf.lite.TFLiteConverter.from_concrete_functions)

import tf_keras  # noqa: E402

tracked = {id(o) for o in gc.get_objects()}
loaded["gc enabled"] = gc.isenabled()
loaded["frozen"] = gc.get_freeze_count()
loaded["tensorflow tracked"] = any(id(f) in tracked for f in (tf.matmul, tf_keras.layers.Dense.call))
cycle = []
cycle.append(cycle)
del cycle
loaded["collected"] = gc.collect()
print(json.dumps(loaded))
