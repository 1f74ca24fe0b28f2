"""Data: synthetic Boltz feature dicts and the data pipeline for context parallelism."""
