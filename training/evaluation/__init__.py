"""Scoring a model beyond its loss: multiple-choice tasks (one rule for the loop's eval.tasks and the harness)
and lm-evaluation-harness on any checkpoint."""
