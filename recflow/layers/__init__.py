"""recflow layers: interactions (FM, DCN-v2 `Cross`), MLPs, DIN attention, MMoE.

`Cross` is TensorFlow Recommenders' DCN-v2 cross layer,
`x_{l+1} = x0 * (W x_l + b) + x_l` with an optional low-rank `projection_dim`.
"""

from tensorflow_recommenders.layers.feature_interaction.dcn import Cross

from recflow.layers.attention import AttentionUnit, DinAttention
from recflow.layers.dice import Dice
from recflow.layers.dnn import DNN
from recflow.layers.fm import FM
from recflow.layers.mmoe import MMoE
from recflow.layers.pooling import MaskedMeanPooling

__all__ = [
    "DNN",
    "FM",
    "AttentionUnit",
    "Cross",
    "Dice",
    "DinAttention",
    "MMoE",
    "MaskedMeanPooling",
]
