"""A package installed into the user's image by its Dockerfile (pip, as root, into trainpod's venv)."""

__version__ = "1.0"
