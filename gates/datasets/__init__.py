"""Dataset registry and resolution (stable API for runners):

    from onecat.gates.datasets import resolve_dataset
    ds = resolve_dataset("wikitext2")          # -> ResolvedDataset(name, path, sha256, origin)
    text = ds.read_text()                      # .gz transparently decompressed

Order: explicit path -> $ONECAT_DATA_DIR -> the package that ships it -> download (pin checked).
Register a dataset with `register_dataset(DatasetSpec(...))` in gates/datasets/catalog.py or any
module in this folder.
"""
from onecat.gates.datasets.spec import (DATA_DIR_ENV, DatasetError, DatasetHashMismatch, DatasetNotFoundError,
                                        DatasetSpec, ResolvedDataset, file_sha256, known_dataset, resolve_dataset)

__all__ = ["DATA_DIR_ENV", "DatasetError", "DatasetHashMismatch", "DatasetNotFoundError", "DatasetSpec",
           "ResolvedDataset", "file_sha256", "known_dataset", "resolve_dataset"]
