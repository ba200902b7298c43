"""Runners: a model and its KV cache behind one interface (runtime/base.py)."""
