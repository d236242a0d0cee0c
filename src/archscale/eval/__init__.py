"""Evaluation and inference."""
