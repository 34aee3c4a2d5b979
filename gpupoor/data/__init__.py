"""Data: raw rows (loading) -> tokens and labels (formats, dataset, cached) -> micro-batches (sampler, build).

This package file imports nothing, so `gpupoor validate` can use the row readers without loading torch."""
