"""Stage 3, generate: one tokenized shard through the engine, with a crash-safe journal."""
