"""Benchmarks (run as scripts: `.venv/bin/python bench/<name>.py`); a package so tests can import their helpers."""
