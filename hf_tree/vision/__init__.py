"""Vision-language trees: image-and-text branches merged by tokens and image identity, each image encoded once.

``MediaTree`` (the data model), ``MediaTreeCollator`` (packing) and ``tree_vision_lm_loss`` (the exact packed
forward and loss); see docs/vision.md.
"""

from hf_tree.vision.collator import MediaTreeCollator
from hf_tree.vision.forward import SUPPORTED, tree_vision_lm_loss, vision_family, vision_model_inputs
from hf_tree.vision.media_tree import MEDIA_TOKEN_BASE, MediaTree

__all__ = [
    "MEDIA_TOKEN_BASE",
    "SUPPORTED",
    "MediaTree",
    "MediaTreeCollator",
    "tree_vision_lm_loss",
    "vision_family",
    "vision_model_inputs",
]
