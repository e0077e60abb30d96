"""Embeds saved inputs with a retrieval export's three signatures (query, candidate,
serving_default) in plain TensorFlow, in a process where `import recflow` fails.

Usage: python serve_two_towers_without_recflow.py EXPORT_DIR INPUTS.npz OUT.npz
OUT.npz holds each signature's embeddings and (as NAME_inputs) its sorted input names.
"""

import sys

sys.modules["recflow"] = None  # any `import recflow` now fails

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

export_dir, inputs, out = sys.argv[1:]
data = np.load(inputs, allow_pickle=True)
loaded = tf.saved_model.load(export_dir)
result = {}
for name in ("query", "candidate", "serving_default"):
    serve = loaded.signatures[name]
    specs = serve.structured_input_signature[1]
    feed = {
        k: tf.constant(data[k].tolist() if specs[k].dtype == tf.string else data[k], specs[k].dtype)
        for k in specs
    }
    result[name] = serve(**feed)["embedding"].numpy()
    result[name + "_inputs"] = np.array(sorted(specs))
np.savez(out, **result)
