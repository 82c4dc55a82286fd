"""Tensor parallelism: splitting one model's weights over several ranks that compute each step together."""
