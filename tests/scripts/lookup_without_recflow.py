"""Looks up the keys (0, 3) and (0, 99) in a saved module's `lookup` function, in plain
TensorFlow, in a process where `import recflow` fails; prints the rows as a JSON list.

Usage: python lookup_without_recflow.py SAVED_DIR
"""

import json
import sys

sys.modules["recflow"] = None  # any `import recflow` now fails

import tensorflow as tf  # noqa: E402

module = tf.saved_model.load(sys.argv[1])
print(json.dumps(module.lookup(tf.constant([[0, 3], [0, 99]], tf.int64)).numpy().tolist()))
