"""tokenmill: EAGLE-3 drafter training data as raw token IDs."""

__version__ = "0.1.0"
