"""Scores three rows of zeros (strings 'a', 'b', 'c') with an export in plain
TensorFlow, in a process where `import recflow` fails; prints `served` when every
probability is in (0, 1).

Usage: python serve_zeros_without_recflow.py EXPORT_DIR
"""

import sys

sys.modules["recflow"] = None  # any `import recflow` now fails

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

f = tf.saved_model.load(sys.argv[1]).signatures["serving_default"]
specs = f.structured_input_signature[1]
feed = {
    k: tf.zeros([3], v.dtype) if v.dtype != tf.string else tf.constant(["a", "b", "c"])
    for k, v in specs.items()
}
p = f(**feed)["probability"].numpy()
assert p.shape == (3, 1) and np.all((p > 0) & (p < 1)), p
print("served")
