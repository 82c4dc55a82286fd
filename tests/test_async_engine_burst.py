"""An idle engine takes a burst of requests into one step (ServeConfig.burst_gap_ms): the requests that arrive
within the gap of the one before start together; with no gap the first starts alone."""
import asyncio
import time
from types import SimpleNamespace

import pytest

from onecat.engine.server.async_engine import AsyncEngine


class FakeCore:
    """Records each step's requests; every request finishes in the step that first runs it."""

    def __init__(self):
        self.waiting, self.steps = [], []

    def has_unfinished(self):
        return bool(self.waiting)

    def add_request(self, request_id, *args, **kwargs):
        self.waiting.append(request_id)

    def step(self):
        ran, self.waiting = self.waiting, []
        self.steps.append(ran)
        return []

    def __contains__(self, request_id):
        return request_id in self.waiting


def fake_llm(core):
    return SimpleNamespace(engine=core, cfg=SimpleNamespace(max_num_seqs=4), tokenize=lambda p, s: (None, p))


async def _burst(engine, spacing_s: float, count: int):
    for i in range(count):
        asyncio.ensure_future(engine.submit(f"r{i}", [1, 2], None))
        await asyncio.sleep(spacing_s)
    await asyncio.sleep(0.2)


@pytest.mark.parametrize("gap_s,first_step", [(0.0, 1), (0.05, 3)])
def test_a_burst_starts_in_one_step_within_the_gap(gap_s, first_step):
    core = FakeCore()
    engine = AsyncEngine(fake_llm(core), burst_gap_s=gap_s)
    try:
        asyncio.run(_burst(engine, 0.01, 3))
    finally:
        engine.shutdown()
    assert len(core.steps[0]) == first_step and sum(map(len, core.steps)) == 3


def test_the_wait_ends_once_max_num_seqs_requests_wait():
    """Four requests fill max_num_seqs: the engine steps at once, without waiting out a gap for a fifth."""
    core = FakeCore()
    engine = AsyncEngine(fake_llm(core), burst_gap_s=0.5)
    started = time.perf_counter()
    try:
        asyncio.run(_burst(engine, 0.0, 4))
    finally:
        engine.shutdown()
    assert core.steps[0] == ["r0", "r1", "r2", "r3"] and time.perf_counter() - started < 0.45
