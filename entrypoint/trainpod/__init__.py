"""trainpod: start, check and launch distributed PyTorch training on any cluster."""

__version__ = "0.1.0"
