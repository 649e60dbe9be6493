"""Parallel primitives of the Plan tree: replicate (data parallel), split (tensor parallel), pipeline."""
