"""Device-side caches the model's layers read and write: the paged KV cache (kv.py) and a hybrid model's
recurrent state (recurrent_state.py). Below the layers, the attention backends and the worker."""
