"""recflow: large sparse recommendation models on TensorFlow, from a YAML config.

Importing recflow selects Keras 2 (`tf_keras`) for TensorFlow: it sets
`TF_USE_LEGACY_KERAS=1` before TensorFlow is first imported. TensorFlow itself
loads on first use of the API:

    recflow.train(config_or_path, model_dir=None, callbacks=None, overrides=None) -> metrics
    recflow.evaluate(config_or_path, model_dir=None, overrides=None) -> metrics
    recflow.export(config_or_path, model_dir=None, overrides=None, delta=False) -> path
"""

import os
import sys

__version__ = "0.1.0"


def _select_keras_2() -> None:
    if "tensorflow" not in sys.modules:
        os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        return
    if os.environ.get("TF_USE_LEGACY_KERAS") not in ("1", "true", "True"):
        raise ImportError(
            "recflow needs Keras 2: TensorFlow was imported before recflow without "
            "TF_USE_LEGACY_KERAS=1; import recflow first or set TF_USE_LEGACY_KERAS=1"
        )


_select_keras_2()

_LAZY = {
    "RankingModel": "recflow.models",
    "register_model": "recflow.models",
    "Head": "recflow.models",
    "register_head": "recflow.models",
    "SparseOptimizer": "recflow.embedding.optimizers",
    "register_sparse_optimizer": "recflow.embedding.optimizers",
    "FeatureKind": "recflow.features.kinds",
    "register_feature_kind": "recflow.features.kinds",
    "load_config": "recflow.config",
    "Config": "recflow.config",
    "train": "recflow.api",
    "evaluate": "recflow.api",
    "export": "recflow.api",
}


def __getattr__(name):
    # Public API without importing TensorFlow at `import recflow`.
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'recflow' has no attribute {name!r}")


__all__ = [
    "Config", "FeatureKind", "Head", "RankingModel", "SparseOptimizer", "evaluate", "export",
    "load_config", "register_feature_kind", "register_head", "register_model",
    "register_sparse_optimizer", "train", "__version__",
]
