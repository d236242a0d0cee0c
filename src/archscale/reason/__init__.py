"""Reasoning evaluation (`archscale reason`): GSM8K, MATH and AIME 2024 answers sampled from a served model or a
checkpoint, scored with the tasks' standard extraction, reported as pass@1 (mean over samples) and unbiased pass@k."""
