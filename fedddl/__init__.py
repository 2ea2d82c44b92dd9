"""fedddl: communication-efficient distributed deep learning on Flower.

Stratified shards, localized parameters with ternary (2-bit) gradients, and
scheduled gossip SGD for wide-area networks.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
