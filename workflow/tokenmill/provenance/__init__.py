"""Stage 5, provenance: the manifest of a run, checking a copy against it, reproducing it."""
