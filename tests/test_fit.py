"""`normalizer: {type: auto}` and the warning for large raw numbers; expected
numbers are computed with numpy from the rows written here."""

from __future__ import annotations

import numpy as np
import yaml

from recflow.config import config_from_dict
from recflow.config.loader import dump_config
from recflow.config.schema import StandardNormalizer
from recflow.data.fit import fit_normalizer, resolve


def test_symmetric_values_are_standardized_as_they_are():
    x = np.array([1.0, 2.0, 3.0, 4.0, np.nan, np.inf], np.float32)
    norm = fit_normalizer(x)
    finite = np.array([1.0, 2.0, 3.0, 4.0])
    assert norm == StandardNormalizer(mean=finite.mean(), std=finite.std(), log1p=False)


def test_heavy_right_tail_is_standardized_after_log1p():
    x = np.array([0.0] * 50 + [1.0] * 30 + [10.0] * 15 + [10_000.0] * 5)
    norm = fit_normalizer(x)
    assert norm.log1p
    assert np.isclose(norm.mean, np.log1p(x).mean()) and np.isclose(norm.std, np.log1p(x).std())


def test_constant_or_empty_sample_keeps_std_one():
    assert fit_normalizer(np.array([5.0, 5.0])) == StandardNormalizer(mean=5.0, std=1.0)
    assert fit_normalizer(np.array([np.nan])) == StandardNormalizer(mean=0.0, std=1.0)


def _feature(config, name):
    return next(f for f in config.features if f.name == name)


def _config(tmp_path, rows, normalizer):
    path = tmp_path / "d.csv"
    path.write_text("\n".join(["u,price,click", *rows]) + "\n", encoding="utf-8")
    raw = {
        "data": {"format": "csv", "train": str(path), "label": "click", "sample_rows": 3},
        "features": [
            {"name": "u", "kind": "categorical"},
            {"name": "price", "kind": "numeric", "normalizer": normalizer},
        ],
    }
    return config_from_dict(raw)


def test_auto_is_fitted_on_the_first_sample_rows_and_reused_from_the_model_dir(tmp_path):
    rows = ["a,1,0", "b,2,1", "c,6,0", "d,1000,1"]  # sample_rows 3: the 1000 is not read
    config = _config(tmp_path, rows, {"type": "auto"})
    resolved, warnings = resolve(config, str(tmp_path / "run"))
    x = np.array([1.0, 2.0, 6.0])
    assert _feature(resolved, "price").normalizer == StandardNormalizer(mean=x.mean(), std=x.std())
    assert warnings == []
    # a resumed run reads the fitted numbers back instead of fitting again
    (tmp_path / "run").mkdir()
    saved = StandardNormalizer(mean=7.0, std=3.0, log1p=True)
    price = _feature(resolved, "price")
    features = tuple(price.__class__(name="price", normalizer=saved) if f.name == "price" else f
                     for f in config.features)
    dump_config(resolved.__class__(**{**resolved.__dict__, "features": features}),
                str(tmp_path / "run" / "config.yaml"))
    again, _ = resolve(config, str(tmp_path / "run"))
    assert _feature(again, "price").normalizer == saved
    stored = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert next(f for f in stored["features"] if f["name"] == "price")["normalizer"] == {"type": "standard", "mean": 7.0, "std": 3.0, "log1p": True}


def test_large_raw_numbers_without_a_normalizer_warn_once(tmp_path):
    config = _config(tmp_path, ["a,1,0", "b,5000,1", "c,-20,0"], None)
    _, warnings = resolve(config)
    assert len(warnings) == 1 and warnings[0].startswith("feature 'price' has no normalizer")
    assert "5000" in warnings[0]
    config = _config(tmp_path, ["a,1,0", "b,999,1"], None)
    assert resolve(config)[1] == []
