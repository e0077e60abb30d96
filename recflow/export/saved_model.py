"""SavedModel export (DESIGN.md section 6).

`serving_default` takes one raw column per feature and runs hashing,
splitting, normalization and the table lookups in the graph. The export holds
embedding rows only (no optimizer slots, no metadata) in core `DenseHashTable`s,
so it loads with `tf.saved_model.load` in a process without recflow.
"""

from __future__ import annotations

import os
import re
import shutil

import tensorflow as tf

from recflow.atomic import staged_dir
from recflow.config.loader import dump_config
from recflow.features.keys import DELETED_KEY, EMPTY_KEY
from recflow.features.transform import serving_dtype, transform
from recflow.models.base import RankingModel


class ServingModule(tf.Module):
    """A frozen copy of a trained model's serving path.

    Args:
        model: the trained model; its dense weights are shared, its tables copied.
    """

    def __init__(self, model: RankingModel):
        super().__init__(name="recflow_serving")
        config = model.config
        engine = model.embedding
        self.tables = []
        dims = []
        for group in engine.groups:
            keys, emb, _, _ = engine.logical_rows(group)
            with tf.device("/cpu:0"):
                table = tf.lookup.experimental.DenseHashTable(
                    key_dtype=tf.int64,
                    value_dtype=tf.float32,
                    default_value=tf.zeros([group.spec.dim]),
                    empty_key=EMPTY_KEY,
                    deleted_key=DELETED_KEY,
                    initial_num_buckets=_buckets(int(keys.shape[0])),
                    name=group.spec.name.replace(".", "_") + "_serving",
                )
                table.insert(keys, emb)
            self.tables.append(table)
            dims.append(group.spec.dim)

        def read(i, keys):
            return tf.reshape(self.tables[i].lookup(keys), [-1, dims[i]])

        def serve(raw):
            features = transform(config, raw)
            ids, dense = model.split_features(features)
            inputs = dict(dense)
            inputs.update(engine.embed_with(ids, read))
            logits = model._logits_by_head(model.tower(inputs, training=False))
            return {h.output: tf.reshape(h.activate(logits[h.name]), [-1, 1]) for h in model.heads}

        signature = {
            f.name: tf.TensorSpec([None], serving_dtype(f), name=f.name) for f in config.features
        }
        self.serve = tf.function(serve, input_signature=[signature])
        self.serving_default = self.serve.get_concrete_function()
        # Traced first: a model restored without a step creates its weights here.
        self.dense_variables = list(model.variables)


def _buckets(n: int) -> int:
    # Power of two with room for the keys at DenseHashTable's max load (0.8).
    return max(16, 1 << int(max(n, 1) / 0.7).bit_length())


def next_version(export_dir: str) -> int:
    versions = existing_versions(export_dir)
    return (versions[-1] + 1) if versions else 1


def existing_versions(export_dir: str) -> list[int]:
    if not os.path.isdir(export_dir):
        return []
    return sorted(int(d) for d in os.listdir(export_dir) if re.fullmatch(r"\d+", d))


def export_saved_model(model: RankingModel, model_dir: str, keep: int | None = None) -> str:
    """Writes `MODEL_DIR/export/<version>/` atomically; keeps the newest `keep` versions."""
    export_dir = os.path.join(model_dir, "export")
    final = os.path.join(export_dir, str(next_version(export_dir)))
    module = ServingModule(model)
    with staged_dir(final) as tmp:
        tf.saved_model.save(
            module, tmp, signatures={"serving_default": module.serving_default}
        )
        extra = os.path.join(tmp, "assets.extra")
        os.makedirs(extra, exist_ok=True)
        dump_config(model.config, os.path.join(extra, "recflow_config.yaml"))
    if keep:
        for old in existing_versions(export_dir)[:-keep]:
            shutil.rmtree(os.path.join(export_dir, str(old)), ignore_errors=True)
    return final
