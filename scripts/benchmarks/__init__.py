"""bench.py's sections and helpers (run it: python bench.py --help)."""
