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


def _arguments(cls: type) -> dict[str, object]:
    """The named keyword arguments of `cls.__init__` (and of its bases' while it passes
    `**kwargs` on), with their defaults."""
    names: dict[str, object] = {}
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = list(inspect.signature(init).parameters.values())
        for p in params:
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self":
                names.setdefault(p.name, p.default)
        if not any(p.kind is p.VAR_KEYWORD for p in params) or klass is keras.optimizers.Optimizer:
            break
    return names


def _check_value(path: str, value, default) -> None:
    """A value of the kind of the argument's default: Keras itself checks few types, and a
    string where a number belongs would fail only inside the first training step."""
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(path, f"expected true or false, got {value!r}")
    elif isinstance(default, (int, float)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(path, f"expected a number, got {value!r}")


def make_dense_optimizer(config: DenseOptimizerConfig) -> keras.optimizers.Optimizer:
    """Builds `train.optimizer`.

    Raises:
        ConfigError: an unknown optimizer, an argument it does not take (or one
            recflow refuses), or a value it rejects; each names its path.
    """
    cls = optimizer_class(config.type)
    arguments = _arguments(cls)
    allowed = sorted(a for a in arguments if a not in _REFUSED and a != "learning_rate")
    for key, value in config.kwargs.items():
        if key in _REFUSED:
            raise ConfigError(
                f"{PATH}.{key}", "not supported: recflow's training loop does not swap in moving averages"
            )
        if key not in allowed:
            raise ConfigError(
                f"{PATH}.{key}", f"not an argument of {cls.__name__} (allowed: {', '.join(allowed)})"
            )
        _check_value(f"{PATH}.{key}", value, arguments[key])
    try:
        return cls(learning_rate=config.learning_rate, **config.kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(PATH, f"{cls.__name__}: {' '.join(str(e).split())}") from None
