"""Stage 4, dataset: merge, validate, export, and the statistics and card of the dataset."""
