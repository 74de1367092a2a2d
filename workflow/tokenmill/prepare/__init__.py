"""Stage 1, prepare: read a category's sources and normalize every record into a prompt."""
