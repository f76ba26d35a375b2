"""Tests that drive JupyterLab in a real browser (see conftest.py)."""
