"""The state every request handler shares: the engine thread, the tokenizer, served names, metrics,
the CPU worker pool and the lazily built grammar compiler. Its own module so that the endpoint
modules can name it without importing the app that routes to them."""
from __future__ import annotations

import threading
import time
from typing import Any

from onecat.engine.server.async_engine import AsyncEngine
from onecat.engine.server.cpu_work import CpuWork
from onecat.engine.server.errors import ApiError
from onecat.engine.server.metrics import ServerMetrics
from onecat.engine.server.serve_config import ServeConfig


class ServerState:
    """What handlers share: the engine thread, the tokenizer, names, metrics, guided decoding."""

    def __init__(self, llm: Any, config: ServeConfig, build: Any = None):
        """`llm`, or None with `build`: a function making the LLM, run on the engine thread (async_engine.py)."""
        self.config = config
        self.metrics = ServerMetrics((config.served_model_name or [config.model])[0],
                                     lambda: getattr(self.llm, "engine", None))
        self.engine = AsyncEngine(llm, build=build, max_queue_len=config.max_queue_len, metrics=self.metrics,
                                  burst_gap_s=config.burst_gap_ms / 1e3)
        self.llm = llm = self.engine.llm
        self.tokenizer = llm.tokenizer
        self.max_model_len = llm.max_model_len
        self.vocab_size = llm.model_config.vocab_size
        self.model_names = config.served_model_name or [config.model]
        self.reasoning_parser = config.reasoning_parser
        self.created = int(time.time())
        self.cpu = CpuWork(config.cpu_workers)
        self._guided = None
        self._guided_lock = threading.Lock()

    @classmethod
    def create(cls, config: ServeConfig) -> "ServerState":
        from onecat.engine import LLM

        return cls(None, config, build=lambda: LLM(**config.engine.as_kwargs()))

    def resolve_model_name(self, name: str | None) -> str:
        if name is None or name in self.model_names:
            return name or self.model_names[0]
        raise ApiError(404, f"The model `{name}` does not exist. Served models: {', '.join(self.model_names)}",
                       param="model")

    def guided(self):
        from onecat.engine.server.guided import GuidedDecoding

        with self._guided_lock:
            if self._guided is None:
                self._guided = GuidedDecoding(self.tokenizer, self.vocab_size)
            return self._guided

    def grammar_for(self, req: Any, schema_override: Any = None) -> str | None:
        from onecat.engine.server.guided import GuidedDecoding

        if schema_override is None and not req.constrained():
            return None
        self.guided()
        if schema_override is not None:
            return GuidedDecoding.grammar_for(json_schema=schema_override)
        return GuidedDecoding.grammar_for(req.response_format.as_dict() if req.response_format else None,
                                          json_schema=req.guided_json, regex=req.guided_regex,
                                          choice=req.guided_choice, lark=req.guided_grammar)

    def close(self) -> None:
        self.engine.shutdown()
        self.cpu.close()
