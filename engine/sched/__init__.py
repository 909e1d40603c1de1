"""Continuous batching: sequences, the scheduler, and the batch it hands the runner each step."""
