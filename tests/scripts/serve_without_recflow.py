"""Scores saved inputs with an export in plain TensorFlow, in a process where
`import recflow` fails: the export must serve without recflow.

Usage: python serve_without_recflow.py EXPORT_DIR INPUTS.npz OUT.npy
"""

import sys

sys.modules["recflow"] = None  # any `import recflow` now fails

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

export_dir, inputs, out = sys.argv[1:]
data = np.load(inputs, allow_pickle=True)
serve = tf.saved_model.load(export_dir).signatures["serving_default"]
specs = serve.structured_input_signature[1]
feed = {
    k: tf.constant(data[k].tolist() if specs[k].dtype == tf.string else data[k], specs[k].dtype)
    for k in specs
}
np.save(out, serve(**feed)["probability"].numpy())
