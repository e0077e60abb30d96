"""Numbers fitted on a sample of the training data before training.

`normalizer: {type: auto}` becomes `{type: standard, mean, std, log1p}` fitted
on the first `data.sample_rows` training rows (file order, missing and
non-finite values left out):

- values all >= 0 with a sample skewness above 2 (counts, prices, durations:
  heavy right tails) are standardized after log1p(x);
- all others are standardized as they are.

The fitted normalizer is what the run's resolved `config.yaml` and every export
hold, so serving applies exactly the training transform; a run that resumes
reads it back from `MODEL_DIR/config.yaml` instead of fitting again.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Callable

import numpy as np
import yaml

from recflow.config.schema import (
    AutoNormalizer,
    Config,
    IdentityNormalizer,
    NumericFeature,
    StandardNormalizer,
)
from recflow.errors import DataError
from recflow.layout import Layout

logger = logging.getLogger(__name__)

SKEW_FOR_LOG = 2.0  # sample skewness above which non-negative values get log1p first
LARGE = 1e3  # |value| of an unnormalized feature that earns a warning


def fit_normalizer(values: np.ndarray) -> StandardNormalizer:
    """The `auto` normalizer of a sample (NaN and inf are left out)."""
    x = np.asarray(values, np.float64)
    x = x[np.isfinite(x)]
    if x.size == 0:
        return StandardNormalizer(mean=0.0, std=1.0)
    log = bool(x.min() >= 0 and _skewness(x) > SKEW_FOR_LOG)
    if log:
        x = np.log1p(x)
    std = float(x.std())
    return StandardNormalizer(mean=float(x.mean()), std=std if std > 0 else 1.0, log1p=log)


def _skewness(x: np.ndarray) -> float:
    std = x.std()
    return float(np.mean(((x - x.mean()) / std) ** 3)) if std > 0 else 0.0


def sample_numbers(config: Config, names: list[str]) -> dict[str, np.ndarray]:
    """Raw values of numeric features over the first `data.sample_rows` training rows."""
    # Imported here: it loads TensorFlow, which `recflow check` (fit_normalizer) does without.
    from recflow.data.pipeline import make_dataset

    ds = make_dataset(config, "train", epochs=1, shuffle=False)
    parts: dict[str, list[np.ndarray]] = {n: [] for n in names}
    rows = 0
    for features, _, _ in ds:
        for name in names:
            parts[name].append(features[name].numpy())
        rows += len(parts[names[0]][-1])
        if rows >= config.data.sample_rows:
            break
    return {
        n: np.concatenate(p)[: config.data.sample_rows] if p else np.zeros(0, np.float32)
        for n, p in parts.items()
    }


def _saved_normalizers(model_dir: str | None) -> dict[str, StandardNormalizer]:
    """The fitted normalizers of a previous run in `model_dir` (by feature name)."""
    path = Layout(model_dir).config_path if model_dir else None
    if not path or not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        raw = yaml.safe_load(f) or {}
    saved = {}
    for feature in raw.get("features") or []:
        norm = feature.get("normalizer") or {}
        if norm.get("type") == "standard":
            saved[feature["name"]] = StandardNormalizer(
                mean=float(norm["mean"]), std=float(norm["std"]), log1p=bool(norm.get("log1p"))
            )
    return saved


def resolve(
    config: Config, model_dir: str | None = None, on_fit: Callable[[list[str]], None] | None = None
) -> tuple[Config, list[str]]:
    """Fits every `auto` normalizer; returns the resolved config and warnings.

    A warning names each numeric feature without a normalizer whose sampled
    values exceed |1e3| (a raw number that large swamps the other inputs).
    `on_fit` is called with the names of the features about to be fitted (those
    not read back from `model_dir`), before the sample is read.
    """
    numeric = config.numeric_features
    autos = [f.name for f in numeric if isinstance(f.normalizer, AutoNormalizer)]
    raw = [f.name for f in numeric if f.normalizer is None or isinstance(f.normalizer, IdentityNormalizer)]
    saved = _saved_normalizers(model_dir)
    fit = [n for n in autos if n not in saved]
    if fit and on_fit is not None:
        on_fit(fit)
    try:
        sample = sample_numbers(config, fit + raw) if fit + raw else {}
    except DataError:
        if fit:
            raise
        sample, raw = {}, []  # no data yet (a stream): nothing to warn about
    fitted = {n: saved[n] if n in saved else fit_normalizer(sample[n]) for n in autos}
    warnings = []
    for name in raw:
        x = sample[name][np.isfinite(sample[name])]
        if x.size and np.abs(x).max() > LARGE:
            warnings.append(
                f"feature '{name}' has no normalizer and values up to {np.abs(x).max():g}; "
                "add `normalizer: {type: auto}` (or log1p / standard)"
            )
    for name, norm in fitted.items():
        logger.info("feature %r: normalizer %s", name, norm)
    features = tuple(
        dataclasses.replace(f, normalizer=fitted[f.name])
        if isinstance(f, NumericFeature) and f.name in fitted
        else f
        for f in config.features
    )
    return dataclasses.replace(config, features=features), warnings


def has_auto(config: Config) -> bool:
    return any(isinstance(f.normalizer, AutoNormalizer) for f in config.numeric_features)
