"""Test and demo tooling, not part of the pipeline: the CPU reference engine, the tiny model."""
