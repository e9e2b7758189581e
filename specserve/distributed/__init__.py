"""Tensor parallelism: a rank's place in its group and the collectives models call (parallel.py), the rank
processes and how step descriptions reach them."""
