"""The engine core decides: which requests run in a step (scheduler, KV block manager), what a step's
logits become (sampler, speculative verify through the proposer) and when a request ends. It runs the
model only through the worker it is given (interfaces.py), so it imports no model code."""
