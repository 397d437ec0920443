"""Run plumbing around the model: configuration, parallel layout, metrics."""
