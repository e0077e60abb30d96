"""The config schema (README "The config"): frozen dataclasses with defaults.

Each section is a dataclass; its `validate()` checks values that the types
alone cannot. Cross-section references (tables, labels, group_by) are checked
in `recflow.config.loader`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from recflow.config.limits import SEED_MAX
from recflow.errors import ConfigError


def _positive(obj: Any, name: str, allow_none: bool = False) -> None:
    value = getattr(obj, name)
    if value is None and allow_none:
        return
    if value is None or value <= 0:
        kind = "integer" if isinstance(value, int) else "number"
        raise ConfigError(name, f"expected a positive {kind}, got {value!r}")


def _seed(obj: Any, name: str) -> None:
    value = getattr(obj, name)
    if not 0 <= value <= SEED_MAX:
        raise ConfigError(name, f"expected an integer in [0, 2**32 - 1], got {value}")


def _non_negative(obj: Any, name: str) -> None:
    value = getattr(obj, name)
    if value < 0:
        raise ConfigError(name, f"expected a non-negative number, got {value!r}")


# ----------------------------------------------------------------------------- data


@dataclass(frozen=True)
class CsvOptions:
    """CSV parsing of the training, eval and predicted files (`data.csv`).

    Attributes:
        delimiter: the field separator, one ASCII character (`"\\t"` in double quotes for a tab).
        header: true: the first line of each file names the columns; false: give `columns`.
        columns: the column names, in file order, of files without a header line.
    """

    delimiter: str = ","
    header: bool = True
    columns: tuple[str, ...] | None = None  # column names when the files have no header

    def validate(self) -> None:
        if len(self.delimiter.encode("utf-8")) != 1:  # TensorFlow's CSV parse splits on one byte
            raise ConfigError("delimiter", f"expected one ASCII character, got {self.delimiter!r}")
        if not self.header and not self.columns:
            raise ConfigError("columns", "required when header is false")


@dataclass(frozen=True)
class SyntheticOptions:
    """The built-in synthetic data set (`data.format: synthetic`), with a planted ground truth.

    Attributes:
        rows: training rows.
        eval_rows: evaluation rows (drawn apart from the training rows).
        seed: seed of the data (the same seed gives the same rows).
        schema: the feature set: `demo` (ids, tags, history, numbers), `criteo` (26 string and 13 numeric columns) or `sequence` (a behaviour sequence for DIN).
    """

    rows: int = 100_000
    eval_rows: int = 20_000
    seed: int = 7
    schema: Literal["demo", "criteo", "sequence"] = "demo"

    def validate(self) -> None:
        _positive(self, "rows")
        _positive(self, "eval_rows")
        _seed(self, "seed")


@dataclass(frozen=True)
class DataConfig:
    """Where the examples come from and how they are read (`data`).

    Attributes:
        format: the file format of `train` and `eval`, or `synthetic` for the built-in data.
        train: training files: a glob or a list of globs (required to train, evaluate or check data, unless `format: synthetic`).
        eval: evaluation files; without them the metrics are computed on the training files.
        label: the label column (a list for several); multitask configs name theirs in `task.tasks`.
        batch_size: rows per training step.
        csv: CSV settings.
        synthetic: synthetic data settings (`format: synthetic` only).
        kafka: the topics a stream run trains on (required for `format: kafka`).
        shuffle: shuffle the training rows each epoch; false keeps file order (reproducible runs).
        shuffle_buffer: records in the shuffle window (blocks of up to 256 consecutive records are shuffled in it).
        seed: shuffle seed; epoch e uses `seed + e`.
        on_bad_record: `skip` counts a bad row (`bad_records` in metrics.json) and goes on; `fail` stops at the first one, naming file and line.
        max_bad_fraction: a pass (training's, or an evaluation's) whose skipped rows exceed this fraction of the rows read stops the run (exit 2).
        positive: label column -> the raw values that are 1; every other value is 0. A value is compared as text after stripping spaces, and a number also by value, in every format: `positive: {rating: [4, 5]}` matches `4`, `4.0` and `0004` in a CSV as it matches a stored 4.0 in a TFRecord float_list or a Parquet number column.
        sample_rows: rows read from the start of `train` to fit `normalizer: {type: auto}`.
        cache: `auto` parses CSV or TFRecord training files once for a run of several epochs (from the second epoch of a `train.steps` run) and reads every epoch's batches from memory, the same batches as parsing again; `off` parses each epoch. Local runs only (not streams or parameter servers).
        cache_dir: where the parsed rows are kept while the run needs them (default `MODEL_DIR/cache`); checked at every load and rebuilt when damaged or made from other files.
    """

    format: Literal["csv", "tfrecord", "parquet", "synthetic", "kafka"] = "csv"
    train: tuple[str, ...] = ()
    eval: tuple[str, ...] = ()
    label: tuple[str, ...] = ()
    batch_size: int = 1024
    csv: CsvOptions = field(default_factory=CsvOptions)
    synthetic: SyntheticOptions = field(default_factory=SyntheticOptions)
    kafka: KafkaOptions | None = None  # required for format: kafka
    shuffle: bool = True
    shuffle_buffer: int = 10_000
    seed: int = 7
    on_bad_record: Literal["skip", "fail"] = "skip"
    # A pass whose skipped rows exceed this fraction of the rows read stops the run.
    max_bad_fraction: float = 0.01
    # label column -> the raw values (stripped) that are 1; every other value is 0.
    positive: dict[str, tuple[str | int, ...]] = field(default_factory=dict)
    # rows read (from the start of data.train) to fit `normalizer: {type: auto}`
    sample_rows: int = 10_000
    cache: Literal["auto", "off", False] = "auto"  # YAML reads a bare `off` as false
    cache_dir: str | None = None

    def validate(self) -> None:
        _positive(self, "batch_size")
        _positive(self, "shuffle_buffer")
        _positive(self, "sample_rows")
        _seed(self, "seed")
        if not 0.0 <= self.max_bad_fraction <= 1.0:
            raise ConfigError(
                "max_bad_fraction", f"expected a number in [0, 1], got {self.max_bad_fraction}"
            )
        for column, values in self.positive.items():
            if not values:
                raise ConfigError(f"positive.{column}", "expected at least one value")

    def positive_values(self, label: str) -> tuple[str, ...] | None:
        """The stripped raw values of `label` that count as 1, or None when not mapped."""
        values = self.positive.get(label)
        return None if values is None else tuple(str(v).strip() for v in values)


# ----------------------------------------------------------------------------- data: kafka


@dataclass(frozen=True)
class KafkaOptions:
    """The Kafka topics a stream run trains on (`data.kafka`).

    Every partition of the topics is read (`assign`, no group rebalancing); `group_id`
    only names the group the trained offsets are committed to, for monitoring.

    Attributes:
        servers: bootstrap servers, `host:port[,host:port...]`.
        topic: the topic read (or `topics`).
        topics: several topics read (or `topic`).
        group_id: the consumer group the trained offsets are committed to after each checkpoint.
        format: a message is one `csv` line (columns `data.csv.columns`) or one `json` object.
        poll_timeout_ms: a partial batch is trained once the stream is caught up and idle this long.
        connect_timeout_s: a broker unreachable this long ends the run with a checkpoint (exit 2), at start or mid-run.
        metadata_interval_s: how often new partitions are looked for.
        queue_batches: whole batches read ahead of the training step.
        client: librdkafka settings passed through (not those recflow owns for exact offsets).
    """

    servers: str = ""
    topic: str | None = None
    topics: tuple[str, ...] = ()
    group_id: str = "recflow"
    format: Literal["csv", "json"] = "csv"
    poll_timeout_ms: int = 500
    connect_timeout_s: float = 30.0
    metadata_interval_s: float = 10.0
    queue_batches: int = 8
    client: dict[str, Any] = field(default_factory=dict)

    # Settings recflow owns: a passthrough value would break exact offsets.
    OWNED: ClassVar[tuple[str, ...]] = (
        "bootstrap.servers",
        "group.id",
        "enable.auto.commit",
        "enable.auto.offset.store",
        "enable.partition.eof",
        "auto.offset.reset",
    )

    def validate(self) -> None:
        if not self.servers.strip():
            raise ConfigError("servers", "required, e.g. servers: 127.0.0.1:9092")
        if (self.topic is None) == (not self.topics):
            raise ConfigError("topic", "set one of topic (a name) or topics (a list)")
        for i, topic in enumerate(self.names):
            if not _TOPIC.fullmatch(topic):
                where = "topic" if self.topic is not None else f"topics[{i}]"
                raise ConfigError(where, f"{topic!r} is not a Kafka topic name ([a-zA-Z0-9._-], 1-249)")
        if len(set(self.names)) != len(self.names):
            raise ConfigError("topics", "a topic is listed twice")
        if not self.group_id:
            raise ConfigError("group_id", "expected a non-empty string")
        _positive(self, "poll_timeout_ms")
        _positive(self, "connect_timeout_s")
        _positive(self, "metadata_interval_s")
        _positive(self, "queue_batches")
        for key, value in self.client.items():
            if key in self.OWNED:
                raise ConfigError(f"client.{key}", "set by recflow (exact offsets); remove it")
            if not isinstance(value, (str, int, float, bool)):
                raise ConfigError(f"client.{key}", f"expected a string, number or boolean, got {value!r}")

    @property
    def names(self) -> tuple[str, ...]:
        """The topics read."""
        return (self.topic,) if self.topic is not None else self.topics


_TOPIC = re.compile(r"[a-zA-Z0-9._-]{1,249}")


def check_kafka(config: Config) -> None:
    """What a stream run from Kafka needs of the other sections."""
    data = config.data
    if data.kafka is None:
        raise ConfigError("data.kafka", "required for format 'kafka' (servers, topic)")
    if data.train:
        raise ConfigError("data.train", "not used with format 'kafka' (the stream is data.kafka); remove it")
    if data.eval:
        raise ConfigError("data.eval", "not supported with format 'kafka'")
    if data.kafka.format == "csv" and not data.csv.columns:
        raise ConfigError(
            "data.csv.columns", "required with data.kafka.format: csv (a message has no header line)"
        )
    if config.distribute.strategy != "local":
        raise ConfigError("distribute.strategy", "format 'kafka' trains with strategy 'local'")
    if config.train.epochs is not None:
        raise ConfigError("train.epochs", "a stream has no epochs; use train.steps or stop it with a signal")
    for i, f in enumerate(config.features):
        normalizer = getattr(f, "normalizer", None)
        if normalizer is not None and type(normalizer).__name__ == "AutoNormalizer":
            raise ConfigError(
                f"features[{i}].normalizer", "type auto needs data files to fit; give mean and std"
            )


# ----------------------------------------------------------------------------- features


@dataclass(frozen=True)
class LogNormalizer:
    """`log(1 + max(x, 0))`.

    Attributes:
        type: selects this normalizer.
    """

    type: Literal["log1p"] = "log1p"


@dataclass(frozen=True)
class StandardNormalizer:
    """(x - mean) / std; with `log1p: true`, of log1p(max(x, 0)) (what `auto` picks for heavy tails).

    Attributes:
        type: selects this normalizer.
        mean: subtracted first (in the units after `log1p`, when set).
        std: divided by next; positive.
        log1p: apply `log1p(max(x, 0))` before standardizing.
    """

    type: Literal["standard"] = "standard"
    mean: float = 0.0
    std: float = 1.0
    log1p: bool = False

    def validate(self) -> None:
        _positive(self, "std")


@dataclass(frozen=True)
class AutoNormalizer:
    """Fitted on `data.sample_rows` training rows before training; the resolved
    config (and the export) holds the `standard` normalizer it becomes.

    Attributes:
        type: selects this normalizer.
    """

    type: Literal["auto"] = "auto"


@dataclass(frozen=True)
class BucketizeNormalizer:
    """The index of the bucket a value falls in, divided by the number of boundaries: a number
    in [0, 1] (`x < b[0]`: 0, `b[0] <= x < b[1]`: 1/len(b), ..., `x >= b[-1]`: 1).

    Attributes:
        type: selects this normalizer.
        boundaries: strictly increasing bucket boundaries.
    """

    type: Literal["bucketize"] = "bucketize"
    boundaries: tuple[float, ...] = ()

    def validate(self) -> None:
        if not self.boundaries:
            raise ConfigError("boundaries", "expected a non-empty list of numbers")
        if list(self.boundaries) != sorted(set(self.boundaries)):
            raise ConfigError("boundaries", "expected strictly increasing numbers")


@dataclass(frozen=True)
class IdentityNormalizer:
    """The value as it is.

    Attributes:
        type: selects this normalizer.
    """

    type: Literal["none"] = "none"


Normalizer = (
    LogNormalizer | StandardNormalizer | BucketizeNormalizer | IdentityNormalizer | AutoNormalizer
)


@dataclass(frozen=True)
class NormalizerSpec:
    """Dispatches on `type`; never instantiated itself."""

    __discriminator__: ClassVar = (
        "type",
        {
            "log1p": LogNormalizer,
            "standard": StandardNormalizer,
            "bucketize": BucketizeNormalizer,
            "none": IdentityNormalizer,
            "auto": AutoNormalizer,
        },
    )


@dataclass(frozen=True)
class Feature:
    """Base of the feature kinds; dispatches on `kind`.

    A kind is its config dataclass (here, or `config_class` of a registered
    `recflow.features.kinds.FeatureKind`): its fields are the keys of the feature's
    mapping, and its properties say how the column is read and what the model makes
    of it, without TensorFlow (the config and the data's headers are checked first).

    Attributes:
        name: the feature's name: the input name of the export's signature, and the column read unless `column` is set.
        column: the source column, when it differs from `name` (several features may read one column).
        kind: `categorical`, `multi_hot`, `sequence`, `numeric`, a registered kind, or `"package.module:ClassName"` of a `FeatureKind`.
    """

    name: str
    column: str | None = None  # source column; defaults to `name`

    is_sparse: ClassVar[bool] = False  # ids looked up in an embedding table

    @property
    def source(self) -> str:
        return self.column or self.name

    @property
    def read_as(self) -> str:
        """How the raw column is read and served: `int64`, `string` or `float`."""
        return "float"

    @property
    def value_separator(self) -> str | None:
        """The separator between the values of a multi-valued column, else None."""
        return None

    @property
    def value_limit(self) -> int | None:
        """The values a multi-valued feature keeps of a row, else None."""
        return None

    @property
    def sequence_length(self) -> int | None:
        """A sparse feature whose ids keep their positions: the tower gets `[B, length, dim]`
        and a mask; None: its embeddings are pooled into `[B, dim]`."""
        return None

    @property
    def pooling(self) -> str:
        """How the embeddings of a row's ids are pooled: `sum`, `mean` or `sqrtn`."""
        return "mean"

    def identity(self) -> dict[str, Any]:
        """What fixes the meaning of the model's variables for this feature
        (`recflow.models.identity`)."""
        return {"kind": self.kind}

    def validate(self) -> None:
        if not self.name or not self.name.replace("_", "a").replace("-", "a").isalnum():
            raise ConfigError("name", f"expected letters, digits, '_' or '-', got {self.name!r}")
        if not self.name[0].isalpha():  # a SavedModel signature would call its input arg_<name>
            raise ConfigError(
                "name",
                f"must start with a letter, got {self.name!r} (a feature may read column "
                f"{self.name!r} with `column: {self.name}`)",
            )


@dataclass(frozen=True)
class SparseFeature(Feature):
    """A feature whose values are ids looked up in an embedding table.

    Attributes:
        dtype: how the column's ids are read: `int64` as integers (a value that is not one is a bad row; an empty one reads as -1), `string` as strings (hashed to keys).
        table: a key of `tables` (features of one dtype may share one); without it the feature gets its own table, named after it.
        dim: embedding size of the feature's own table (not allowed with `table`); default `embedding.default_dim`.
    """

    dtype: Literal["int64", "string"] = "string"
    table: str | None = None  # a key of `tables`; defaults to a table named after the feature
    dim: int | None = None  # only for a feature with its own table

    is_sparse: ClassVar[bool] = True

    @property
    def read_as(self) -> str:
        return "string"  # multi-valued columns are separator-joined strings whatever their dtype

    def identity(self) -> dict[str, Any]:
        return {**super().identity(), "dtype": self.dtype, "table": self.table_name}

    def validate(self) -> None:
        super().validate()
        _positive(self, "dim", allow_none=True)
        if self.table is not None and self.dim is not None:
            raise ConfigError("dim", "set the dim on the table, not on a feature with `table`")

    @property
    def table_name(self) -> str:
        return self.table or self.name


@dataclass(frozen=True)
class CategoricalFeature(SparseFeature):
    """One id per row."""

    kind: Literal["categorical"] = "categorical"

    @property
    def read_as(self) -> str:
        return self.dtype


@dataclass(frozen=True)
class MultiHotFeature(SparseFeature):
    """A set of ids per row, joined by `separator` in the column, pooled with `combiner`.

    Attributes:
        separator: the string between ids.
        combiner: how the ids' embeddings are pooled into one vector.
        max_values: a row keeps its first `max_values` ids; cut rows are counted (`truncated_rows`).
    """

    kind: Literal["multi_hot"] = "multi_hot"
    separator: str = "|"
    combiner: Literal["sum", "mean", "sqrtn"] = "mean"
    max_values: int = 1000  # longer rows keep their first max_values values (counted)

    @property
    def value_separator(self) -> str:
        return self.separator

    @property
    def value_limit(self) -> int:
        return self.max_values

    @property
    def pooling(self) -> str:
        return self.combiner

    def identity(self) -> dict[str, Any]:
        return {**super().identity(), "combiner": self.combiner}

    def validate(self) -> None:
        super().validate()
        _positive(self, "max_values")
        if not self.separator:
            raise ConfigError("separator", "expected a non-empty string")


@dataclass(frozen=True)
class SequenceFeature(SparseFeature):
    """An ordered list of ids per row (e.g. a behaviour history), padded or cut to `max_len`.

    Attributes:
        separator: the string between ids.
        max_len: ids kept per row (the first ones); shorter rows are padded and masked.
    """

    kind: Literal["sequence"] = "sequence"
    separator: str = "|"
    max_len: int = 20

    @property
    def value_separator(self) -> str:
        return self.separator

    @property
    def value_limit(self) -> int:
        return self.max_len

    @property
    def sequence_length(self) -> int:
        return self.max_len

    def identity(self) -> dict[str, Any]:
        return {**super().identity(), "max_len": self.max_len}

    def validate(self) -> None:
        super().validate()
        _positive(self, "max_len")
        if not self.separator:
            raise ConfigError("separator", "expected a non-empty string")


@dataclass(frozen=True)
class NumericFeature(Feature):
    """A number per row, normalized.

    Attributes:
        normalizer: how the raw number is transformed; none: used as it is.
        default: raw value (before the normalizer) used when the value is missing or not finite; null: neutral (the mean under `standard` and `auto`, else 0).
    """

    kind: Literal["numeric"] = "numeric"
    normalizer: NormalizerSpec | None = None
    # Raw value used when missing or not finite; None: neutral (the normalizer's mean,
    # 0 after `standard`/`auto`; 0 raw otherwise).
    default: float | None = None

    def identity(self) -> dict[str, Any]:
        entry = super().identity()
        if self.normalizer is not None:
            entry["normalizer"] = self.normalizer.type
            if isinstance(self.normalizer, BucketizeNormalizer):
                entry["boundaries"] = list(self.normalizer.boundaries)
        return entry


Feature.__discriminator__ = (
    "kind",
    {
        "categorical": CategoricalFeature,
        "multi_hot": MultiHotFeature,
        "sequence": SequenceFeature,
        "numeric": NumericFeature,
    },
)

# ----------------------------------------------------------------------------- tables


@dataclass(frozen=True)
class InitializerConfig:
    """How a new embedding row is initialized.

    Attributes:
        type: the distribution.
        mean: mean of `normal` and `truncated_normal`.
        stddev: standard deviation of `normal` and `truncated_normal`.
        minval: lower bound of `uniform`.
        maxval: upper bound of `uniform`.
    """

    type: Literal["truncated_normal", "normal", "uniform", "zeros"] = "truncated_normal"
    mean: float = 0.0
    stddev: float = 0.01
    minval: float = -0.01
    maxval: float = 0.01

    def validate(self) -> None:
        _non_negative(self, "stddev")
        if self.minval > self.maxval:
            raise ConfigError("minval", f"expected minval <= maxval, got {self.minval} > {self.maxval}")


@dataclass(frozen=True)
class SGDConfig:
    """Plain gradient descent on rows (no slots).

    Attributes:
        type: selects this optimizer.
        learning_rate: step size.
    """

    type: Literal["sgd"] = "sgd"
    learning_rate: float = 0.01

    def validate(self) -> None:
        _positive(self, "learning_rate")


@dataclass(frozen=True)
class AdagradConfig:
    """Adagrad on rows (one accumulator slot per value).

    Attributes:
        type: selects this optimizer.
        learning_rate: step size.
        initial_accumulator_value: the accumulator of a new row.
        epsilon: added to the denominator.
    """

    type: Literal["adagrad"] = "adagrad"
    learning_rate: float = 0.05
    initial_accumulator_value: float = 0.1
    epsilon: float = 1e-7

    def validate(self) -> None:
        _positive(self, "learning_rate")
        _non_negative(self, "initial_accumulator_value")
        _non_negative(self, "epsilon")
        if self.initial_accumulator_value == 0 and self.epsilon == 0:  # 0 / (sqrt(0) + 0) on a zero gradient
            raise ConfigError("epsilon", "expected a positive number when initial_accumulator_value is 0, got 0")


@dataclass(frozen=True)
class AdamConfig:
    """Sparse Adam on rows. The default learning rate (5e-3) is the default sparse
    optimizer: at or above DeepCTR's DeepFM (Adam 1e-3) on every synthetic schema
    (scripts/compare_deepctr.py --defaults; table in docs/performance.md).

    Attributes:
        type: selects this optimizer.
        learning_rate: step size.
        beta_1: decay of the first-moment estimate, in [0, 1).
        beta_2: decay of the second-moment estimate, in [0, 1).
        epsilon: added to the denominator.
    """

    type: Literal["adam"] = "adam"
    learning_rate: float = 0.005
    beta_1: float = 0.9
    beta_2: float = 0.999
    epsilon: float = 1e-7

    def validate(self) -> None:
        _positive(self, "learning_rate")
        for name in ("beta_1", "beta_2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(name, f"expected a number in [0, 1), got {getattr(self, name)}")
        _positive(self, "epsilon")  # a value never updated has m = v = 0: 0 / (sqrt(0) + 0)


@dataclass(frozen=True)
class FtrlConfig:
    """FTRL-Proximal on rows.

    Attributes:
        type: selects this optimizer.
        learning_rate: step size.
        learning_rate_power: the power of the learning rate schedule; at most 0.
        initial_accumulator_value: the accumulator of a new row.
        l1: L1 regularization strength.
        l2: L2 regularization strength.
        beta: the FTRL beta.
    """

    type: Literal["ftrl"] = "ftrl"
    learning_rate: float = 0.05
    learning_rate_power: float = -0.5
    initial_accumulator_value: float = 0.1
    l1: float = 0.0
    l2: float = 0.0
    beta: float = 0.0

    def validate(self) -> None:
        _positive(self, "learning_rate")
        _non_negative(self, "l1")
        _non_negative(self, "l2")
        if self.learning_rate_power > 0:
            raise ConfigError("learning_rate_power", "expected a number <= 0")


OptimizerConfig = SGDConfig | AdagradConfig | AdamConfig | FtrlConfig  # the built-in ones


@dataclass(frozen=True)
class OptimizerSpec:
    """Dispatches on `type`; never instantiated itself."""

    __discriminator__: ClassVar = (
        "type",
        {"sgd": SGDConfig, "adagrad": AdagradConfig, "adam": AdamConfig, "ftrl": FtrlConfig},
    )


@dataclass(frozen=True)
class AdmissionConfig:
    """When a new key gets a trainable row.

    Attributes:
        min_count: sightings before a key gets a row; until then it holds only a counter and reads the zero row.
    """

    min_count: int = 1

    def validate(self) -> None:
        _positive(self, "min_count")


@dataclass(frozen=True)
class EvictionConfig:
    """Which rows are removed at each checkpoint; at least one of the two.

    Attributes:
        ttl_steps: remove rows (and waiting admission counters) unseen for this many steps.
        max_keys: keep at most this many rows, the most frequent first (then the most recent); each of N shards keeps max_keys // N. It bounds this table alone, also when it is fused with others.
    """

    ttl_steps: int | None = None
    max_keys: int | None = None

    def validate(self) -> None:
        _positive(self, "ttl_steps", allow_none=True)
        _positive(self, "max_keys", allow_none=True)
        if self.ttl_steps is None and self.max_keys is None:
            raise ConfigError("ttl_steps", "set ttl_steps and/or max_keys")


@dataclass(frozen=True)
class TableConfig:
    """A logical embedding table (`tables.<name>`); tables that agree on dim, initializer, optimizer and policies are fused into one physical table.

    Attributes:
        dim: embedding size.
        initializer: initial values of a new row.
        optimizer: the table's sparse optimizer; default `train.sparse_optimizer`.
        admission: admission policy; none: every key gets a row when first seen.
        eviction: eviction policy; none: rows are never removed.
        expected_keys: sizes the table up front for this many keys with a row (all shards), so it does not grow step by step.
    """

    dim: int = 8
    initializer: InitializerConfig = field(default_factory=InitializerConfig)
    optimizer: OptimizerSpec | None = None  # defaults to train.sparse_optimizer
    admission: AdmissionConfig | None = None
    eviction: EvictionConfig | None = None
    expected_keys: int | None = None  # sizes the table up front (keys with a row, all shards)

    def validate(self) -> None:
        _positive(self, "dim")
        _positive(self, "expected_keys", allow_none=True)


@dataclass(frozen=True)
class EmbeddingConfig:
    """Settings shared by every embedding table (`embedding`).

    Attributes:
        fusion: fuse compatible tables into one physical table (one lookup chain per step); `recflow plan` shows the plan.
        default_dim: embedding size of a table a feature gets implicitly (no `table`, no `dim`).
    """

    fusion: bool = True
    default_dim: int = 8  # dim of a table a feature gets implicitly

    def validate(self) -> None:
        _positive(self, "default_dim")


# ----------------------------------------------------------------------------- model, task


@dataclass(frozen=True)
class ModelConfig:
    """The model (`model`).

    Attributes:
        type: a registered model name (`deepfm`, `wide_deep`, `dcn`, `din`, `mmoe`, `two_tower`) or `"package.module:ClassName"`.
        params: keyword arguments of the model class (e.g. `{dnn: {hidden_units: [256, 128]}}`).
    """

    type: str = "deepfm"
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TaskSpec:
    """One head of a multi-task model.

    Attributes:
        name: the head's name: its output name in the export and the prefix of its metrics (`NAME/auc`).
        label: its label column.
        type: the head: `binary` (sigmoid cross-entropy), `regression` (mean squared error), another registered head, or `"package.module:ClassName"`.
        weight: its weight in the summed loss.
    """

    name: str
    label: str
    type: str = "binary"
    weight: float = 1.0

    def validate(self) -> None:
        _non_negative(self, "weight")


@dataclass(frozen=True)
class TaskConfig:
    """The task: the head(s) that turn the tower's logits into a loss, predictions,
    metrics and export outputs (`recflow.models.heads`). `retrieval`: every row with
    label > 0 is a positive (query, candidate) pair; the loss is a softmax over the
    batch's candidates (in-batch negatives); candidates whose embeddings are equal within
    a cosine of 0.99999 count as one (a copy of a row's own candidate is no negative of
    it). recall@K ranks the split's distinct candidates, told apart by the ids the
    candidate tower reads.

    Attributes:
        type: the head: `binary`, `regression`, `retrieval`, another registered head, or `"package.module:ClassName"`; `multitask` lists its heads in `tasks`.
        metrics: metrics to compute (binary: `auc`, `logloss`, `gauc`, `accuracy`; regression: `mse`, `mae`, `rmse`; retrieval: `recall@K`; a head of your own: its own); default: the head's defaults (auc and logloss, mse, recall@10). Checked against the heads when the model is built.
        group_by: the feature that groups examples for `gauc` (AUC per group, weighted by group size).
        tasks: the heads of a `multitask` model.
    """

    type: str = "binary"
    metrics: tuple[str, ...] | None = None  # defaults by head
    group_by: str | None = None  # the feature that groups examples for gauc
    tasks: tuple[TaskSpec, ...] = ()  # multitask heads

    def validate(self) -> None:
        if self.type == "multitask" and not self.tasks:
            raise ConfigError("tasks", "required for type 'multitask'")
        if self.type != "multitask" and self.tasks:
            raise ConfigError("tasks", "only allowed for type 'multitask'")
        if "gauc" in (self.metrics or ()) and not self.group_by:
            raise ConfigError("group_by", "required when metrics include 'gauc'")


# ----------------------------------------------------------------------------- train, export


@dataclass(frozen=True)
class DenseOptimizerConfig:
    """The optimizer of the dense weights (tower, first-order bias): any Keras optimizer.

    The mapping's other keys are the optimizer's keyword arguments, e.g.
    `{type: adamw, learning_rate: 0.001, weight_decay: 0.01}`; names the optimizer
    does not take are errors (checked when the model is built).

    Attributes:
        type: a `tf_keras.optimizers` class by name, any case (`adam`, `adamw`, `sgd`, `rmsprop`, `adagrad`, `adadelta`, `adamax`, `nadam`, `ftrl`, `lion`, `adafactor`), or `"package.module:ClassName"` of a `tf_keras` optimizer.
        learning_rate: step size.
        kwargs: not a key itself: every other key of the mapping, passed to the optimizer (e.g. `weight_decay`, `momentum`, `clipnorm`).
    """

    type: str = "adam"
    learning_rate: float = 0.001
    kwargs: dict[str, Any] = field(default_factory=dict)

    __extra__: ClassVar[str] = "kwargs"

    def validate(self) -> None:
        _positive(self, "learning_rate")


@dataclass(frozen=True)
class TrainConfig:
    """The training run (`train`).

    Attributes:
        model_dir: the directory of the run's checkpoints, logs, metrics and exports.
        epochs: passes over `data.train` in total, not per run (default 1 when `steps` is not set).
        steps: steps in total, instead of `epochs`.
        optimizer: the dense weights' optimizer.
        sparse_optimizer: the embedding tables' optimizer, unless a table sets its own.
        checkpoint_every_steps: checkpoint (and evict) every N steps; null: only at the end.
        checkpoint_every_seconds: also checkpoint when this many seconds have passed since the last one (streams).
        keep_checkpoints: checkpoints kept.
        log_every_steps: write the loss and examples/s to TensorBoard (`MODEL_DIR/logs`) every N steps.
        seed: seed of the dense initial weights, dropout and new embedding rows.
        xla: compile the tower's forward and backward pass with XLA.
        prefetch_embeddings: parameter servers: each step looks up the next batch's rows while it computes.
        evaluate: evaluate the final model when the run ends; `false` for a run whose metrics nobody reads (`recflow evaluate` computes them later from the checkpoint).
    """

    model_dir: str = "runs/default"
    epochs: int | None = None
    steps: int | None = None
    optimizer: DenseOptimizerConfig = field(default_factory=DenseOptimizerConfig)
    sparse_optimizer: OptimizerSpec = field(default_factory=AdamConfig)
    checkpoint_every_steps: int | None = 1000
    checkpoint_every_seconds: float | None = None
    keep_checkpoints: int = 3
    log_every_steps: int = 100
    seed: int = 7
    xla: bool = False  # compile the tower's forward and backward pass with XLA
    # Parameter servers: each step looks up the next batch's rows while it computes
    # (docs/distributed.md, "Prefetching embeddings").
    prefetch_embeddings: bool = False
    evaluate: bool = True

    def validate(self) -> None:
        _positive(self, "epochs", allow_none=True)
        _positive(self, "steps", allow_none=True)
        _positive(self, "checkpoint_every_steps", allow_none=True)
        _positive(self, "checkpoint_every_seconds", allow_none=True)
        _positive(self, "keep_checkpoints")
        _positive(self, "log_every_steps")
        _seed(self, "seed")
        if self.epochs is not None and self.steps is not None:
            raise ConfigError("steps", "set either epochs or steps, not both")
        if not self.model_dir:
            raise ConfigError("model_dir", "expected a non-empty path")

    @property
    def total_epochs(self) -> int | None:
        if self.steps is not None:
            return None
        return self.epochs or 1


@dataclass(frozen=True)
class ExportConfig:
    """Exports and deltas written during training (`export`).

    Attributes:
        every_steps: also export a SavedModel version every N steps (online learning).
        at_end: export a SavedModel version when the run ends; `false` for a run whose export nobody reads (`recflow export` writes it later from the checkpoint).
        delta_every_steps: write `deltas/<step>/` with the rows updated since the previous delta every N steps.
        every_seconds: also export a version when this many seconds have passed since the last one (streams).
        delta_every_seconds: also write a delta when this many seconds have passed since the last one (streams).
        keep: SavedModel versions kept in `MODEL_DIR/export`.
    """

    every_steps: int | None = None
    at_end: bool = True
    delta_every_steps: int | None = None
    every_seconds: float | None = None
    delta_every_seconds: float | None = None
    keep: int = 5

    def validate(self) -> None:
        _positive(self, "every_steps", allow_none=True)
        _positive(self, "delta_every_steps", allow_none=True)
        _positive(self, "every_seconds", allow_none=True)
        _positive(self, "delta_every_seconds", allow_none=True)
        _positive(self, "keep")


@dataclass(frozen=True)
class DistributeConfig:
    """Where training runs (`distribute`).

    Attributes:
        strategy: `local`: one process; `parameter_server`: ParameterServerStrategy, roles from `TF_CONFIG` (`recflow launch` runs a local cluster).
    """

    strategy: Literal["local", "parameter_server"] = "local"


@dataclass(frozen=True)
class Config:
    """A whole recflow config file.

    Attributes:
        version: the config format version.
        data: input data.
        features: the model's inputs, one entry per feature.
        tables: embedding tables by name; a sparse feature without `table` gets its own.
        embedding: settings of all tables.
        model: the model class and its parameters.
        task: the loss, heads and metrics.
        train: the training run.
        export: scheduled exports and deltas.
        distribute: single process or parameter servers.
    """

    version: Literal[1] = 1
    data: DataConfig = field(default_factory=DataConfig)
    features: tuple[Feature, ...] = ()
    tables: dict[str, TableConfig] = field(default_factory=dict)
    embedding: EmbeddingConfig = field(default_factory=EmbeddingConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    distribute: DistributeConfig = field(default_factory=DistributeConfig)

    # ---- derived views used across the package

    @property
    def sparse_features(self) -> tuple[Feature, ...]:
        return tuple(f for f in self.features if f.is_sparse)

    @property
    def numeric_features(self) -> tuple[NumericFeature, ...]:
        return tuple(f for f in self.features if not f.is_sparse)

    def feature(self, name: str) -> Feature:
        for f in self.features:
            if f.name == name:
                return f
        raise KeyError(name)

    def table(self, name: str) -> TableConfig:
        """The table config of a logical table, implicit ones included."""
        if name in self.tables:
            return self.tables[name]
        for f in self.sparse_features:
            if f.table is None and f.name == name:
                return TableConfig(dim=f.dim or self.embedding.default_dim)
        raise KeyError(name)

    def table_names(self) -> tuple[str, ...]:
        """Logical tables in use, in first-use order."""
        names: list[str] = []
        for f in self.sparse_features:
            if f.table_name not in names:
                names.append(f.table_name)
        return tuple(names)

    def sparse_optimizer(self, table: str) -> OptimizerConfig:
        return self.table(table).optimizer or self.train.sparse_optimizer

    @property
    def binary_labels(self) -> frozenset[str]:
        """The labels of binary heads (each must be 0 or 1)."""
        if self.task.type == "multitask":
            return frozenset(t.label for t in self.task.tasks if t.type == "binary")
        return frozenset(self.data.label) if self.task.type == "binary" else frozenset()

    @property
    def labels(self) -> tuple[str, ...]:
        if self.task.type == "multitask":
            return tuple(t.label for t in self.task.tasks)
        return self.data.label
