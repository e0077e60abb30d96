"""`RankingModel`: the base every model extends by writing one hook, `tower`.

The base owns feature transforms, the dynamic embeddings (fused, sharded),
the task heads and their losses, `train_step`, and the inputs the tower sees:

    categorical, multi_hot  [B, dim]          pooled embedding
    sequence                [B, max_len, dim] and mask_key(name) [B, max_len] bool
    numeric                 [B, 1]            normalized
    linear_key(name)        [B, 1]            first-order weight (when `first_order = True`)

(`recflow.models.mask_key` / `linear_key` name those inputs.)
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import tensorflow as tf
import tf_keras as keras

from recflow.config.schema import Config
from recflow.embedding import wire
from recflow.embedding.engine import EmbeddingEngine
from recflow.embedding.placement import Placement
from recflow.errors import ConfigError
from recflow.features.transform import transform
from recflow.models.heads import Head, heads_for
from recflow.models.inputs import Lookup, empty_column, feature_of, linear_key, mask_key


class RankingModel(keras.Model):
    """Base ranking model.

    Args:
        config: the run config.
        placement: embedding shard placement (parameter servers); local by default.

    Subclasses override `tower(inputs, training)` and return logits `[B, 1]`, or
    `{task_name: logits}` for multi-task configs. Set the class attribute
    `first_order = True` to receive per-feature first-order weights.
    """

    first_order = False

    def __init__(self, config: Config, placement: Placement | None = None, **kwargs):
        super().__init__(name=kwargs.pop("name", type(self).__name__.lower()), **kwargs)
        self.config = config
        self.heads: list[Head] = heads_for(config)
        self.embedding = EmbeddingEngine(config, placement, first_order=self.first_order)
        self.global_step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step")
        self.bad_records = tf.Variable(0, dtype=tf.int64, trainable=False, name="bad_records")
        # The tower is traced as its own function: AutoGraph converts user code here even
        # when the step around it is traced without it; `train.xla` compiles it with XLA.
        self._train_tower = tf.function(
            lambda inputs: self.tower(inputs, training=True), jit_compile=config.train.xla
        )
        self._infer_tower = tf.function(lambda inputs: self.tower(inputs, training=False))

    # ------------------------------------------------------------------ the hook

    def tower(self, inputs: dict, training: bool = False):
        """Maps tower inputs to logits. Subclasses implement this."""
        raise NotImplementedError(f"{type(self).__name__} must implement `tower`")

    # ------------------------------------------------------------------ helpers for towers

    def pooled(self, inputs: dict) -> list[tf.Tensor]:
        """Every sparse feature in `inputs` as `[B, dim]`; sequences mean-pooled over their mask."""
        out = []
        for feature in self.config.sparse_features:
            if feature.name not in inputs:  # a retrieval tower sees only its side's features
                continue
            value = inputs[feature.name]
            if feature.sequence_length is not None:
                mask = tf.cast(inputs[mask_key(feature.name)], value.dtype)[:, :, None]
                value = tf.reduce_sum(value * mask, 1) / tf.maximum(tf.reduce_sum(mask, 1), 1.0)
            out.append(value)
        return out

    def numeric(self, inputs: dict) -> tf.Tensor | None:
        """All numeric features in `inputs` concatenated, `[B, n]`, or None when there are none."""
        values = [inputs[f.name] for f in self.config.numeric_features if f.name in inputs]
        return tf.concat(values, axis=1) if values else None

    def first_order_logit(self, inputs: dict) -> tf.Tensor:
        """Sum of the sparse features' first-order weights, `[B, 1]`."""
        weights = [inputs[linear_key(f.name)] for f in self.config.sparse_features]
        return tf.add_n(weights)

    # ------------------------------------------------------------------ forward

    def split_features(self, features: dict) -> tuple[dict, dict]:
        """Transformed features -> (sparse ids, numeric tensors)."""
        ids = {f.name: features[f.name] for f in self.config.sparse_features}
        dense = {f.name: features[f.name] for f in self.config.numeric_features}
        return ids, dense

    def forward(self, features: dict, training: bool = False, lookup: Lookup | None = None) -> dict:
        """Columns -> every head's logits, `{head.name: logits}`: the one forward pass of
        `call`, `build_weights`, the training step and the export's serving functions.

        Raw columns -> feature transforms (with `lookup.raw`) -> embedding lookups
        (`lookup.embed`) -> tower -> the heads' logits. Inside a traced function the
        tower runs as its own traced function (AutoGraph converts user code there even
        when the function around it is traced without it; `train.xla` compiles the
        training one with XLA); run eagerly, it runs as written (and creates its weights).

        Args:
            features: one column per feature: transformed (the input pipeline's form),
                or raw with `lookup.raw`.
            training: the training pass (dropout on).
            lookup: how the rows are read (`recflow.models.inputs.Lookup`); default:
                the training tables, read-only (unknown keys read zeros).
        """
        lookup = lookup or Lookup(self.embedding.embed)
        given = set(features)
        if lookup.raw:
            batch = tf.shape(next(iter(features.values())))[:1]
            raw = {
                f.name: features[f.name] if f.name in given else empty_column(f, batch)
                for f in self.config.features
            }
            features = transform(self.config, raw)
        ids, inputs = self.split_features(features)
        inputs.update(lookup.embed(ids))
        inputs = {k: v for k, v in inputs.items() if feature_of(k) in given}
        if tf.executing_eagerly():
            outputs = self.tower(inputs, training=training)
        else:
            outputs = (self._train_tower if training else self._infer_tower)(inputs)
        if len(self.heads) != 1 and not isinstance(outputs, dict):
            raise ConfigError("model.type", f"the tower returned {type(outputs).__name__}; a multi-task "
                                            "tower returns {task name: logits}")
        return {h.name: h.logits_of(outputs) for h in self.heads}

    def predictions(self, logits: dict) -> dict:
        """The heads' logits (`forward`) -> `{head.output: activated prediction}`."""
        return {h.output: h.activate(logits[h.name]) for h in self.heads}

    def call(self, features: dict, training: bool = False) -> dict:
        """Transformed features -> {head output name: activated prediction [B, 1]}."""
        return self.predictions(self.forward(features, training))

    def predict_raw(self, raw: dict) -> dict:
        """Raw columns (serving form) -> predictions."""
        return self.predictions(self.forward(raw, lookup=Lookup(self.embedding.embed, raw=True)))

    def build_weights(self) -> None:
        """Creates the dense weights and the optimizer's slots now (one eager pass over an
        empty row), so a training step is traced once instead of twice (a tf.function
        that creates variables on its first trace is traced again)."""
        empty = {f.name: empty_column(f, tf.constant([1])) for f in self.config.features}
        self.forward(empty, lookup=Lookup(self.embedding.embed, raw=True))
        if self.optimizer is not None and self.trainable_variables:
            self.optimizer.build(self.trainable_variables)

    # ------------------------------------------------------------------ training

    def compute_total_loss(self, labels: dict, logits: dict) -> tf.Tensor:
        loss = tf.add_n([h.weight * h.loss(labels[h.label], logits[h.name]) for h in self.heads])
        if self.losses:
            loss += tf.add_n(self.losses)
        return loss

    def train_step(self, data):
        loss, _ = self.train_on_rows(data)
        return {"loss": loss}

    def train_on_rows(self, data, prefetch=None, in_loop: bool = False):
        """One training step; returns (loss, the token of the rows it staged, or None).

        Args:
            data: (features, labels, bad-record count), one batch.
            prefetch: a `recflow.distribute.chunk.Prefetch` from a caller that
                prefetches: the batch's rows are read from its staging slot, and
                the next batch's are looked up while this step computes, brought
                up to date with its writes (`embedding.refresh`) and staged.
                None reads the batch's rows now.
            in_loop: the step runs inside a `tf.while_loop` (`train_chunk`).
        """
        features, labels, bad = data
        ids, _ = self.split_features(features)
        engine = self.embedding
        if prefetch is None:
            fetched = engine.fetch(ids)
        else:
            fetched = engine.staged(prefetch.slot, prefetch.keys, after=prefetch.staged)
            ahead = engine.lookup(prefetch.following)  # issued before this step writes
        step = self.global_step.assign_add(1)
        self.bad_records.assign_add(tf.cast(bad, tf.int64))
        states = engine.states(fetched, step)
        rows = [s.emb for s in states]
        with tf.GradientTape() as tape:
            tape.watch(rows)
            lookup = Lookup(lambda ids: engine.embed_step(states, ids))
            logits = self.forward(features, training=True, lookup=lookup)
            loss = self.compute_total_loss(labels, logits)
        variables = self.trainable_variables
        grads = tape.gradient(loss, list(variables) + rows)
        self._apply_dense(grads[: len(variables)], variables, in_loop)
        written = engine.apply(states, grads[len(variables) :], step)
        if prefetch is None:
            return loss, None
        return loss, engine.stage(prefetch.slot, engine.refresh(ahead, written))

    def _apply_dense(self, grads: list, variables: list, in_loop: bool) -> None:
        """The dense optimizer's update.

        Inside a `tf.while_loop` Keras cannot aggregate gradients across replicas
        (no `merge_call` in control flow). recflow runs one replica per process (a
        parameter-server worker too), so there is nothing to aggregate: each
        variable takes what `apply_gradients` does (clipping, weight decay, the
        optimizer's update step, constraints), on the variable's device. Under
        parameter servers only the gradients travel there, packed into one tensor
        per device (a cross-process tensor is one RPC).
        """
        pairs = [(g, v) for g, v in zip(grads, variables) if g is not None]
        if not pairs:
            return
        optimizer = self.optimizer
        if not in_loop:
            optimizer.apply_gradients(pairs)
            return
        with tf.init_scope():
            optimizer.build([v for _, v in pairs])
        clipped = optimizer._clip_gradients([g for g, _ in pairs])
        pairs = [(g, v) for g, (_, v) in zip(clipped, pairs)]
        with tf.name_scope("dense_update"):
            for device, group in _by_device(pairs).items():
                unpack = _pack([g for g, _ in group])
                with tf.device(device):
                    optimizer._apply_weight_decay([v for _, v in group])
                    for grad, (_, variable) in zip(unpack(), group):
                        optimizer._update_step(grad, variable)
                        if variable.constraint is not None:
                            variable.assign(variable.constraint(variable))
            with tf.device(optimizer.iterations.device):
                optimizer.iterations.assign_add(1)


def _by_device(pairs: list) -> dict:
    """(gradient, variable) pairs grouped by the variable's device, in order."""
    groups: dict = {}
    for grad, variable in pairs:
        groups.setdefault(variable.device, []).append((grad, variable))
    return groups


def _pack(grads: list) -> Callable[[], list]:
    """Packs dense float32 gradients into one tensor here; the returned function unpacks them.

    Call the function under the device that uses the gradients: the packed
    tensor crosses to it once. Sparse (`IndexedSlices`) and other gradients pass
    as they are.
    """
    dense = [
        i for i, g in enumerate(grads) if isinstance(g, tf.Tensor) and g.dtype == tf.float32
    ]
    if len(dense) < 2 or any(not grads[i].shape.is_fully_defined() for i in dense):
        return lambda: list(grads)
    flat = wire.pack([grads[i] for i in dense])
    sizes = [grads[i].shape.num_elements() for i in dense]

    def unpack():
        out = list(grads)
        for i, piece in zip(dense, tf.split(flat, sizes)):
            out[i] = tf.reshape(piece, grads[i].shape)
        return out

    return unpack


class RetrievalModel(RankingModel):
    """Base two-tower retrieval model, for `task.type: retrieval`.

    Args:
        config: the run config.
        query_features: names of the features the query tower reads.
        candidate_features: names of the features the candidate tower reads;
            disjoint from `query_features`, and together they cover every feature.
        temperature: the loss divides the query-candidate dot products by it
            (None: 1).
        logq_correction: correct the loss for how often each candidate occurs in
            the batch (see `recflow.models.heads.retrieval_loss`).
        placement: embedding shard placement (parameter servers); local by default.

    Subclasses override `query_tower(inputs, training)` and
    `candidate_tower(inputs, training)`, each returning embeddings `[B, d]`;
    each side receives only the tower inputs of its own features. `tower` returns
    `{"query": [B, d], "candidate": [B, d]}`, and the model's output is
    `{"embeddings": {"query": .., "candidate": ..}}`. The loss is an in-batch
    softmax (`recflow.models.heads.retrieval_loss`). The export has a `query` and
    a `candidate` signature, each over its own features' raw columns.
    """

    def __init__(
        self,
        config: Config,
        query_features,
        candidate_features,
        temperature: float | None = None,
        logq_correction: bool = True,
        placement: Placement | None = None,
        **kwargs,
    ):
        names = [f.name for f in config.features]
        sides = {}
        for arg, value in (
            ("query_features", query_features),
            ("candidate_features", candidate_features),
        ):
            if isinstance(value, str) or not isinstance(value, (list, tuple)) or not value:
                raise ValueError(
                    f"`{arg}` must be a non-empty list of feature names. Received: {arg}={value!r}"
                )
            for name in value:
                if name not in names:
                    raise ValueError(f"`{arg}`: no feature {name!r} (features: {', '.join(names)})")
            if len(set(value)) != len(value):
                raise ValueError(f"`{arg}` lists a feature twice. Received: {arg}={value!r}")
            sides[arg] = tuple(value)
        both = [
            n for n in names if n in sides["query_features"] and n in sides["candidate_features"]
        ]
        if both:
            raise ValueError(
                f"feature {both[0]!r} is in both `query_features` and `candidate_features`"
            )
        neither = [
            n for n in names if n not in sides["query_features"] + sides["candidate_features"]
        ]
        if neither:
            raise ValueError(
                f"feature {neither[0]!r} is in neither `query_features` nor `candidate_features`"
                " (every feature feeds one tower)"
            )
        if temperature is not None and (
            isinstance(temperature, bool)
            or not isinstance(temperature, (int, float))
            or temperature <= 0
        ):
            raise ValueError(
                f"`temperature` must be a positive number. Received: temperature={temperature!r}"
            )
        if not isinstance(logq_correction, bool):
            raise ValueError(
                f"`logq_correction` must be a bool. Received: logq_correction={logq_correction!r}"
            )
        super().__init__(config, placement=placement, **kwargs)
        self.query_features = sides["query_features"]
        self.candidate_features = sides["candidate_features"]
        self.heads = [
            dataclasses.replace(h, temperature=temperature, logq_correction=logq_correction)
            for h in self.heads
        ]

    def query_tower(self, inputs: dict, training: bool = False) -> tf.Tensor:
        """Query-side tower inputs -> query embeddings `[B, d]`. Subclasses implement this."""
        raise NotImplementedError(f"{type(self).__name__} must implement `query_tower`")

    def candidate_tower(self, inputs: dict, training: bool = False) -> tf.Tensor:
        """Candidate-side tower inputs -> candidate embeddings `[B, d]`. Subclasses implement this."""
        raise NotImplementedError(f"{type(self).__name__} must implement `candidate_tower`")

    def side_tower(self, side: str, inputs: dict, training: bool = False) -> tf.Tensor:
        """The embeddings of one side ("query" or "candidate") from all tower inputs."""
        names = self.query_features if side == "query" else self.candidate_features
        own = {k: v for k, v in inputs.items() if feature_of(k) in names}  # masks too
        tower = self.query_tower if side == "query" else self.candidate_tower
        return tower(own, training=training)

    def tower(self, inputs: dict, training: bool = False) -> dict:
        """`{"query": [B, d], "candidate": [B, d]}`; a side whose features are not in
        `inputs` (a serving signature over the other side's columns) is left out."""
        sides = {"query": self.query_features, "candidate": self.candidate_features}
        return {
            side: self.side_tower(side, inputs, training)
            for side, names in sides.items()
            if all(name in inputs for name in names)
        }

