"""RankingModel base (+ registry), task heads (+ registry) and the model zoo."""

from recflow.models.base import RankingModel, build_model
from recflow.models.heads import Head, register_head
from recflow.models.inputs import linear_key, mask_key
from recflow.models.registry import get_model_class, register_model, registered_models

__all__ = [
    "Head", "RankingModel", "build_model", "get_model_class", "linear_key", "mask_key",
    "register_head", "register_model", "registered_models",
]
