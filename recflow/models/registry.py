"""Model registry: `model.type` is a registered name or `package.module:ClassName`;
`build_model` instantiates it.

The built-in models (`recflow.models.zoo`) register when `recflow.models` is imported.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

from recflow.config import model_module
from recflow.config.schema import Config
from recflow.embedding.placement import Placement
from recflow.errors import ConfigError
from recflow.models.base import RankingModel, RetrievalModel
from recflow.models.heads import RetrievalHead, heads_for

_MODELS: dict[str, type] = {}


def register_model(name: str):
    """Class decorator: makes a `RankingModel` subclass available as `model.type: name`."""

    def wrap(cls):
        model_module.register(_MODELS, name, cls, RankingModel, "model")
        cls.registered_name = name
        return cls

    return wrap


def registered_models() -> list[str]:
    return sorted(_MODELS)


def get_model_class(type_name: str) -> type:
    """Resolves `model.type`; errors name the config path.

    A `module:ClassName` module off the Python path is imported from the folder that
    `recflow.config.model_module.locate` found it in (the config's folder or the
    working directory) when the config was loaded.
    """
    if model_module.is_class_path(type_name):
        return model_module.import_class(type_name, "model.type", RankingModel, "RankingModel")
    if type_name not in _MODELS:
        known = ", ".join(sorted(_MODELS))
        raise ConfigError("model.type", f"no model {type_name!r} (registered: {known})")
    return _MODELS[type_name]


_SUPPLIED = ("self", "config", "placement")  # passed by recflow, not by model.params


def model_parameters(cls: type) -> tuple[list[str], list[str]]:
    """The names `model.params` may set on `cls`, and those it must set.

    The allowed names are the named arguments of `cls.__init__` and, while an
    `__init__` takes `**kwargs` (which a model passes on to `super().__init__`), of
    its bases' up to `RankingModel`, which takes `name`. The required ones are the
    arguments of the first `__init__` without a default.
    """
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


def build_model(config: Config, placement: Placement | None = None) -> RankingModel:
    """Instantiates `config.model` with its params.

    Raises:
        ConfigError: an unknown model, params it does not take, or a model that does
            not fit the task (a retrieval model needs `task.type: retrieval`, and back).
    """
    cls = get_model_class(config.model.type)
    retrieval = any(isinstance(h, RetrievalHead) for h in heads_for(config))
    if retrieval and not issubclass(cls, RetrievalModel):
        raise ConfigError(
            "model.type",
            f"task.type 'retrieval' needs a retrieval model (e.g. 'two_tower'), got {config.model.type!r}",
        )
    if issubclass(cls, RetrievalModel) and not retrieval:
        raise ConfigError(
            "task.type",
            f"model {config.model.type!r} is a retrieval model: expected 'retrieval', got {config.task.type!r}",
        )
    params = config.model.params
    check_params(cls, config.model.type, params)
    try:
        return cls(config, placement=placement, **params)
    except (TypeError, ValueError) as e:
        raise ConfigError("model.params", " ".join(str(e).split())) from None
