"""The dense weights' optimizer (`train.optimizer`): any `tf_keras` optimizer.

`type` names a class of `tf_keras.optimizers` (any case: `adamw`, `AdamW`) or a
user's `tf_keras` optimizer as `"package.module:ClassName"`; the mapping's other
keys are its keyword arguments, checked against the class's `__init__`, so a
misspelt one is an error naming its path instead of a silent default.
"""

from __future__ import annotations

import inspect

import tf_keras as keras

from recflow.config import model_module
from recflow.config.schema import DenseOptimizerConfig
from recflow.errors import ConfigError

PATH = "train.optimizer"

# Moving averages of the weights are swapped in only by Keras `fit`; recflow's own loop
# never would, so the trained weights would silently be the raw ones.
_REFUSED = ("use_ema", "ema_momentum", "ema_overwrite_frequency")


def keras_optimizers() -> dict[str, type]:
    """Lower-case name -> class, for every optimizer of `tf_keras.optimizers`."""
    out = {}
    for name in dir(keras.optimizers):
        obj = getattr(keras.optimizers, name)
        if (
            isinstance(obj, type)
            and issubclass(obj, keras.optimizers.Optimizer)
            and obj is not keras.optimizers.Optimizer
        ):
            out[name.lower()] = obj
    return out


def optimizer_class(type_name: str) -> type:
    """The Keras optimizer class that `train.optimizer.type` names."""
    if model_module.is_class_path(type_name):
        return model_module.import_class(
            type_name, f"{PATH}.type", keras.optimizers.Optimizer, "tf_keras optimizer"
        )
    known = keras_optimizers()
    cls = known.get(type_name.lower())
    if cls is None:
        raise ConfigError(
            f"{PATH}.type",
            f"no Keras optimizer {type_name!r} (known: {', '.join(sorted(known))}; "
            "or 'package.module:ClassName')",
        )
    return cls


def _arguments(cls: type) -> list[str]:
    """The named keyword arguments of `cls.__init__` (and of its bases' while it passes
    `**kwargs` on)."""
    names: list[str] = []
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = list(inspect.signature(init).parameters.values())
        for p in params:
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self":
                if p.name not in names:
                    names.append(p.name)
        if not any(p.kind is p.VAR_KEYWORD for p in params) or klass is keras.optimizers.Optimizer:
            break
    return names


def make_dense_optimizer(config: DenseOptimizerConfig) -> keras.optimizers.Optimizer:
    """Builds `train.optimizer`.

    Raises:
        ConfigError: an unknown optimizer, an argument it does not take (or one
            recflow refuses), or a value it rejects; each names its path.
    """
    cls = optimizer_class(config.type)
    allowed = [a for a in _arguments(cls) if a not in _REFUSED]
    for key in config.kwargs:
        if key in _REFUSED:
            raise ConfigError(
                f"{PATH}.{key}", "not supported: recflow's training loop does not swap in moving averages"
            )
        if key not in allowed or key == "learning_rate":
            raise ConfigError(
                f"{PATH}.{key}",
                f"not an argument of {cls.__name__} (allowed: {', '.join(sorted(allowed))})",
            )
    try:
        return cls(learning_rate=config.learning_rate, **config.kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(PATH, f"{cls.__name__}: {' '.join(str(e).split())}") from None
