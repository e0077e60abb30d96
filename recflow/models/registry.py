"""Model registry: `model.type` is a registered name or `package.module:ClassName`."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping

from recflow.config import model_module
from recflow.errors import ConfigError

_MODELS: dict[str, type] = {}


def register_model(name: str):
    """Class decorator: makes a `RankingModel` subclass available as `model.type: name`."""

    def wrap(cls):
        model_module.register(_MODELS, name, cls, None, "model")
        cls.registered_name = name
        return cls

    return wrap


def registered_models() -> list[str]:
    _load_zoo()
    return sorted(_MODELS)


def _load_zoo() -> None:
    importlib.import_module("recflow.models.zoo")


def get_model_class(type_name: str) -> type:
    """Resolves `model.type`; errors name the config path.

    A `module:ClassName` module off the Python path is imported from the folder that
    `recflow.config.model_module.locate` found it in (the config's folder or the
    working directory) when the config was loaded.
    """
    from recflow.models.base import RankingModel

    if model_module.is_class_path(type_name):
        return model_module.import_class(type_name, "model.type", RankingModel, "RankingModel")
    _load_zoo()
    if type_name not in _MODELS:
        known = ", ".join(sorted(_MODELS))
        raise ConfigError("model.type", f"no model {type_name!r} (registered: {known})")
    cls = _MODELS[type_name]
    if not (isinstance(cls, type) and issubclass(cls, RankingModel)):
        raise ConfigError("model.type", f"{type_name!r} is not a RankingModel subclass")
    return cls


_SUPPLIED = ("self", "config", "placement")  # passed by recflow, not by model.params


def model_parameters(cls: type) -> tuple[list[str], list[str]]:
    """The names `model.params` may set on `cls`, and those it must set.

    The allowed names are the named arguments of `cls.__init__` and, while an
    `__init__` takes `**kwargs` (which a model passes on to `super().__init__`), of
    its bases' up to `RankingModel`, which takes `name`. The required ones are the
    arguments of the first `__init__` without a default.
    """
    from recflow.models.base import RankingModel

    allowed: list[str] = []
    required: list[str] = []
    first = True
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        if klass is RankingModel:
            allowed.append("name")
            break
        params = list(inspect.signature(init).parameters.values())
        for p in params:
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in _SUPPLIED:
                if p.name not in allowed:
                    allowed.append(p.name)
                if first and p.default is p.empty:
                    required.append(p.name)
        first = False
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return allowed, required


def check_params(cls: type, type_name: str, params: Mapping) -> None:
    """Checks `model.params` against the model's `__init__` before anything is built.

    Raises:
        ConfigError: `model.params.foo: unknown parameter of deepfm (allowed: ...)`,
            or a required parameter missing.
    """
    allowed, required = model_parameters(cls)
    for key in params:
        if key not in allowed:
            raise ConfigError(
                f"model.params.{key}",
                f"unknown parameter of {type_name} (allowed: {', '.join(sorted(allowed))})",
            )
    for name in required:
        if name not in params:
            raise ConfigError(f"model.params.{name}", f"required by {type_name}")
