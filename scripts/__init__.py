"""Scripts around the trainer, run from the repository's root: python -m scripts.bench, python scripts/plot.py, ..."""
