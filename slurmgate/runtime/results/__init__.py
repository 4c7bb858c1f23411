"""Benchmark results in InferenceX's format: the tools' raw output read, judged and written."""
