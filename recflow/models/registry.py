"""Model registry: `model.type` is a registered name or `package.module:ClassName`."""

from __future__ import annotations

import importlib

from recflow.errors import ConfigError

_MODELS: dict[str, type] = {}


def register_model(name: str):
    """Class decorator: makes a `RankingModel` subclass available as `model.type: name`."""

    def wrap(cls):
        if name in _MODELS and _MODELS[name] is not cls:
            raise ValueError(f"a model named {name!r} is already registered ({_MODELS[name]!r})")
        _MODELS[name] = cls
        cls.registered_name = name
        return cls

    return wrap


def registered_models() -> list[str]:
    _load_zoo()
    return sorted(_MODELS)


def _load_zoo() -> None:
    importlib.import_module("recflow.models.zoo")


def get_model_class(type_name: str) -> type:
    """Resolves `model.type`; errors name the config path."""
    from recflow.models.base import RankingModel

    if ":" in type_name:
        module_name, _, class_name = type_name.partition(":")
        if not module_name or module_name.startswith(".") or not class_name:
            raise ConfigError(
                "model.type",
                f"expected an absolute 'package.module:ClassName', got {type_name!r}",
            )
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise ConfigError("model.type", f"cannot import {module_name!r} ({e})") from None
        cls = getattr(module, class_name, None)
        if cls is None:
            raise ConfigError("model.type", f"module {module_name!r} has no class {class_name!r}")
    else:
        _load_zoo()
        if type_name not in _MODELS:
            known = ", ".join(sorted(_MODELS))
            raise ConfigError("model.type", f"no model {type_name!r} (registered: {known})")
        cls = _MODELS[type_name]
    if not (isinstance(cls, type) and issubclass(cls, RankingModel)):
        raise ConfigError("model.type", f"{type_name!r} is not a RankingModel subclass")
    return cls
