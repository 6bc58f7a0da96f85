"""Accuracy alignment: tolerance model, operator checks, tensor dumps, run-vs-run comparison."""
