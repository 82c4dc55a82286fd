"""Markdown (and later plot) rendering of runs from the results store."""
