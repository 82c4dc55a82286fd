"""Training DFlash block drafters for targets the engine runs: `train_drafter(target, data, out, **options)`.

Imports only onecat.engine (the drafter's math lives once, in engine/speculative/dflash.py)."""
__all__ = ["DEFAULT_DATA", "TrainOptions", "TrainResult", "train_drafter"]


def __getattr__(name):  # `import onecat.training.prompts` stays light: torch loads only for training
    if name in ("TrainResult", "train_drafter"):
        from onecat.training import api

        return getattr(api, name)
    if name in ("DEFAULT_DATA", "TrainOptions"):
        from onecat.training import options

        return getattr(options, name)
    raise AttributeError(name)
