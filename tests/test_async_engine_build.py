"""The server's engine thread can build its own LLM, so that every torch op of the engine (loading
included) runs on one thread: CPU OpenMP keeps one thread pool per calling thread, and an idle second
pool made decode through `onecat serve` about twice as slow on a 2-core box."""
import threading
from types import SimpleNamespace

import pytest

from onecat.engine.errors import ConfigError
from onecat.engine.server.async_engine import AsyncEngine


def fake_llm():
    return SimpleNamespace(engine=SimpleNamespace(has_unfinished=lambda: False), cfg=SimpleNamespace(max_num_seqs=4))


def test_the_llm_is_built_on_the_engine_thread():
    seen = {}

    def build():
        seen["thread"] = threading.current_thread()
        return fake_llm()

    engine = AsyncEngine(build=build, max_queue_len=8)
    try:
        assert seen["thread"] is engine._thread and seen["thread"] is not threading.current_thread()
        assert engine.alive and engine.max_in_flight == 12
        assert engine.run_sync(lambda llm: threading.current_thread()) is engine._thread
    finally:
        engine.shutdown()


def test_a_failed_build_raises_its_error_and_leaves_no_thread_running():
    def build():
        raise ConfigError("model 'nope' not found")

    def engine_threads():
        return {t for t in threading.enumerate() if t.name == "onecat-engine" and t.is_alive()}

    before = engine_threads()
    with pytest.raises(ConfigError, match="nope"):
        AsyncEngine(build=build)
    for t in engine_threads() - before:
        t.join(5)
    assert engine_threads() <= before


def test_either_an_llm_or_a_build_function():
    with pytest.raises(ValueError, match="either"):
        AsyncEngine()
    with pytest.raises(ValueError, match="either"):
        AsyncEngine(fake_llm(), build=fake_llm)
