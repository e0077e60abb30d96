"""DeepFM on TFRA dynamic embeddings: the TFRA side of scripts/bench_train.py.

Runs inside the side virtualenv (TF 2.16.2 + tf-keras 2.16 +
tensorflow-recommenders-addons 0.8.1) that `bench_train.py` builds; it does not
import recflow. Input: an .npz per split with the raw Criteo-like columns
(label, I1..I13 floats with NaN, C1..C26 strings with "" for missing).

The model mirrors recflow's and DeepCTR's DeepFM: per C column one
`tfra.dynamic_embedding.keras.layers.BasicEmbedding` (int64 keys = the string's
64-bit fingerprint, computed in the graph like recflow) whose rows hold
`[first-order weight | dim embedding]` (one table per column: the layout most
favorable to TFRA), FM over the embeddings, a linear term and a ReLU DNN over
embeddings + log1p numerics. Every parameter trains with
`tfra.dynamic_embedding.DynamicEmbeddingOptimizer(Adam)` (its slots live in
separate hash tables).

Usage:
    python scripts/tfra_deepfm.py --train T.npz --eval E.npz --scores OUT.npy
        [--dim 8] [--hidden 256,128] [--batch-size 4096] [--epochs 1] [--lr 0.005]

Prints one JSON line: {"bench": "tfra_deepfm", "job_seconds": ..., ...}; the eval
scores go to --scores (the caller computes the AUC).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

C_COLUMNS = tuple(f"C{i}" for i in range(1, 27))
I_COLUMNS = tuple(f"I{i}" for i in range(1, 14))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--train", required=True, help="train .npz")
    p.add_argument("--eval", required=True, help="eval .npz")
    p.add_argument("--scores", required=True, help="write eval scores here (.npy)")
    p.add_argument("--dim", type=int, default=8)
    p.add_argument("--hidden", default="256,128", help="DNN hidden units (default 256,128)")
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.005)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument(
        "--optimizer", choices=["legacy", "v2"], default="legacy",
        help="legacy: tf_keras.optimizers.legacy.Adam (default); v2: tf_keras.optimizers.Adam",
    )  # fmt: skip
    p.add_argument(
        "--loop", choices=["custom", "fit"], default="custom",
        help="custom: a tf.function(autograph=False) train step (default); fit: keras Model.fit",
    )  # fmt: skip
    return p.parse_args(argv)


def _callbacks(keras):
    if not os.environ.get("TFRA_STEP_TIMES"):
        return []

    class T(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.t = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            print(f"step {batch}: {time.perf_counter() - self.t:.3f}s", file=sys.stderr, flush=True)

    return [T()]


def main(argv=None) -> int:
    args = parse_args(argv)
    import tensorflow as tf
    import tensorflow_recommenders_addons as tfra
    import tf_keras as keras

    de = tfra.dynamic_embedding
    hidden = [int(u) for u in args.hidden.split(",") if u]
    keras.utils.set_random_seed(args.seed)

    def load(path):
        with np.load(path) as z:
            return {k: z[k] for k in z.files}

    train, evaluation = load(args.train), load(args.eval)

    class TfraDeepFM(keras.Model):
        def __init__(self):
            super().__init__()
            init = keras.initializers.RandomNormal(stddev=0.01, seed=args.seed)
            self.tables = [
                de.keras.layers.BasicEmbedding(
                    args.dim + 1,
                    key_dtype=tf.int64,
                    value_dtype=tf.float32,
                    initializer=init,
                    name=f"emb_{c}",
                )  # fmt: skip
                for c in C_COLUMNS
            ]
            self.numeric_linear = keras.layers.Dense(1)
            self.dnn = [keras.layers.Dense(u, activation="relu") for u in hidden]
            self.out = keras.layers.Dense(1)

        def call(self, x, training=False):
            rows = []
            for c, table in zip(C_COLUMNS, self.tables):
                keys = tf.strings.to_hash_bucket_fast(tf.strings.strip(x[c]), 2**62)
                rows.append(tf.reshape(table(keys), [-1, args.dim + 1]))
            rows = tf.stack(rows, axis=1)  # [B, 26, dim + 1]
            linear, emb = rows[:, :, 0], rows[:, :, 1:]
            numeric = []
            for c in I_COLUMNS:
                v = tf.cast(x[c], tf.float32)
                v = tf.where(tf.math.is_nan(v), tf.zeros_like(v), v)
                numeric.append(tf.math.log1p(tf.maximum(v, 0.0)))
            numeric = tf.stack(numeric, axis=1)  # [B, 13]
            s = tf.reduce_sum(emb, axis=1)
            fm = 0.5 * tf.reduce_sum(
                s * s - tf.reduce_sum(emb * emb, axis=1), axis=1, keepdims=True
            )
            h = tf.concat([tf.reshape(emb, [-1, 26 * args.dim]), numeric], axis=1)
            for layer in self.dnn:
                h = layer(h)
            logit = tf.reduce_sum(linear, 1, keepdims=True) + self.numeric_linear(numeric) + fm
            return tf.sigmoid(logit + self.out(h))

    def dataset(cols, shuffle_seed=None):
        n = len(cols["label"])
        order = (
            np.random.default_rng(shuffle_seed).permutation(n) if shuffle_seed is not None else None
        )
        feats = {
            c: (cols[c][order] if order is not None else cols[c]) for c in C_COLUMNS + I_COLUMNS
        }
        labels = cols["label"].astype(np.float32)
        if order is not None:
            labels = labels[order]
        return (
            tf.data.Dataset.from_tensor_slices((feats, labels)).batch(args.batch_size).prefetch(2)
        )

    began = time.perf_counter()
    model = TfraDeepFM()
    adam = keras.optimizers.legacy.Adam if args.optimizer == "legacy" else keras.optimizers.Adam
    optimizer = de.DynamicEmbeddingOptimizer(adam(learning_rate=args.lr))
    model.compile(optimizer=optimizer, loss="binary_crossentropy")
    loss_fn = keras.losses.BinaryCrossentropy()

    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y[:, None], model(x, training=True))
        variables = model.trainable_variables
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return loss

    # Python loops over a fixed column list only: autograph would just re-convert TFRA's internals.
    step_fn = tf.function(train_step, autograph=False)
    predict_fn = tf.function(lambda x: model(x, training=False), autograph=False)
    built = time.perf_counter()
    for epoch in range(args.epochs):
        ds = dataset(train, args.seed + epoch)
        if args.loop == "fit":
            model.fit(ds, epochs=1, verbose=0, callbacks=_callbacks(keras))
            continue
        for i, (x, y) in enumerate(ds):
            t = time.perf_counter()
            step_fn(x, y).numpy()
            if os.environ.get("TFRA_STEP_TIMES"):
                print(f"step {i}: {time.perf_counter() - t:.3f}s", file=sys.stderr, flush=True)
    trained = time.perf_counter()
    if args.loop == "fit":
        scores = model.predict(dataset(evaluation), verbose=0).reshape(-1)
    else:
        scores = np.concatenate([predict_fn(x).numpy().reshape(-1) for x, _ in dataset(evaluation)])
    ended = time.perf_counter()
    np.save(args.scores, scores)
    examples = len(train["label"]) * args.epochs
    sizes = [int(t.params.size()) for t in model.tables]
    print(json.dumps({
        "bench": "tfra_deepfm", "tensorflow": tf.__version__, "tfra": tfra.__version__,
        "build_seconds": built - began, "fit_seconds": trained - built, "eval_seconds": ended - trained,
        "job_seconds": ended - began, "examples": examples,
        "fit_examples_per_sec": examples / (trained - built), "keys": sum(sizes),
    }), flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
