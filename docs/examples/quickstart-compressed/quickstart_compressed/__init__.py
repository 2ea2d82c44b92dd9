"""quickstart_compressed: Flower's PyTorch quickstart with fedddl's drop-in ternary compression."""
