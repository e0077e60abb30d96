"""RankingModel base (+ registry), task heads (+ registry) and the model zoo.

Importing the package registers the built-in models (`recflow.models.zoo`).
"""

from recflow.models import zoo  # noqa: F401 (registers the built-in models)
from recflow.models.base import RankingModel
from recflow.models.heads import Head, register_head
from recflow.models.inputs import linear_key, mask_key
from recflow.models.registry import build_model, get_model_class, register_model, registered_models

__all__ = [
    "Head", "RankingModel", "build_model", "get_model_class", "linear_key", "mask_key",
    "register_head", "register_model", "registered_models",
]
