"""Data sources (CSV, TFRecord, Parquet, synthetic) -> tf.data pipelines.

`check_sources` and `bad_record_message` work without TensorFlow (so the CLI can
check a config's data before the slow TensorFlow import); the dataset builders
import TensorFlow on first use.

Example:
    >>> check_sources(config)                      # globs, headers, columns
    >>> ds = make_dataset(config, "train", epochs=1)
    >>> features, labels, bad = next(iter(ds))
"""

from recflow.data.sources import bad_record_message, check_sources

_LAZY = {
    "make_dataset": "recflow.data.pipeline",
    "make_file_dataset": "recflow.data.pipeline",
    "generate": "recflow.data.synthetic",
    "oracle_auc": "recflow.data.synthetic",
    "write_synthetic": "recflow.data.writer",
}


def __getattr__(name):
    # The dataset builders import TensorFlow; load them on first use only.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'recflow.data' has no attribute {name!r}")


__all__ = [
    "bad_record_message",
    "check_sources",
    "generate",
    "make_dataset",
    "make_file_dataset",
    "oracle_auc",
    "write_synthetic",
]
