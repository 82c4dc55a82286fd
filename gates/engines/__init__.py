"""Engines of the gate harness; each module registers itself with a decorator (see gates/registry.py)."""
