"""Helpers for tests, benchmarks and device checks, not used by the engine: random model directories and
their shapes (``random_model``) and the float64 NumPy sampling reference (``reference_sampler``)."""
