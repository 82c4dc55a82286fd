"""Drafters committed with the engine, as package data: one folder per drafter (config.json +
model.safetensors), resolved by model_source as `embedded:<folder name>`."""
