"""Benchmark helpers: real prompt data sets and a transformers baseline."""
