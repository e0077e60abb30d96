"""Applies a model dir's deltas to an export with plain TensorFlow and numpy, as any
serving runtime would, in a process where `import recflow` fails.

Usage: python apply_deltas_without_recflow.py MODEL_DIR START_STEP ROWS.npz OUT.npz
OUT.npz holds the export's scores of the rows before the deltas (`before`), after them
(`applied`), the newest full export's scores (`full`) and the step reached (`step`).
"""

import json
import os
import sys

sys.modules["recflow"] = None  # any `import recflow` now fails

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

model_dir, start, inputs, out = sys.argv[1:]
rows = dict(np.load(inputs, allow_pickle=True))


def predict(model):
    serve = model.signatures["serving_default"]
    specs = serve.structured_input_signature[1]
    feed = {
        k: tf.constant(rows[k].tolist() if specs[k].dtype == tf.string else rows[k], specs[k].dtype)
        for k in specs
    }
    return serve(**feed)["probability"].numpy().reshape(-1)


model = tf.saved_model.load(os.path.join(model_dir, "export", start))
before = predict(model)
deltas = sorted(int(d) for d in os.listdir(os.path.join(model_dir, "deltas")))
spec = model.apply_delta.structured_input_signature[0][0]
for step in [d for d in deltas if d > int(start)]:
    folder = os.path.join(model_dir, "deltas", str(step))
    with open(os.path.join(folder, "manifest.json"), encoding="utf-8") as f:
        manifest = json.load(f)
    feed = {
        "step": tf.constant(step, tf.int64),
        "dense": tf.constant(np.load(os.path.join(folder, "dense.npy"))),
    }
    for table in manifest["tables"]:
        data = np.load(os.path.join(folder, table + ".npz"))
        feed[table + "/ids"] = tf.constant(data["keys"])
        feed[table + "/values"] = tf.constant(data["values"])
        feed[table + "/evicted"] = tf.constant(data["evicted"])
    assert sorted(feed) == sorted(spec)
    assert int(model.apply_delta(feed)["step"]) == step
full = tf.saved_model.load(os.path.join(model_dir, "export", str(deltas[-1])))
np.savez(
    out, before=before, applied=predict(model), full=predict(full), step=int(model.global_step)
)
