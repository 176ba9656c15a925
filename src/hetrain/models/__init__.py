"""Example model definitions, kept apart from how they are parallelised (torchtitan-style).

Every model is an ``nn.Sequential`` whose children are the pipeline *layers* of docs/model.md §2
(layer
``l`` of a profile or a plan is child ``l``). Importing this package imports torch.
"""

from hetrain.models.charlm import CharGPTConfig, char_gpt
from hetrain.models.digits import digits_cnn

__all__ = ["CharGPTConfig", "char_gpt", "digits_cnn"]
