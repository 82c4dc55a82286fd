"""Shared fixtures: the embedded model, tiny random-init HF checkpoints, and the data folder."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
if "ONECAT_DATA_DIR" not in os.environ and SHARED_DATA.is_dir():
    os.environ["ONECAT_DATA_DIR"] = str(SHARED_DATA)

EMBEDDED = "embedded:smollm2-135m-instruct"


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU; none is present")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def embedded_llm():
    from onecat.engine import LLM

    return LLM(EMBEDDED, max_model_len=2048, max_num_seqs=16)


@pytest.fixture(scope="session")
def embedded_path() -> Path:
    from onecat.engine.model_source import resolve_model_source

    return resolve_model_source(EMBEDDED).path
