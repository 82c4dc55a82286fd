"""Responses to the training prompts, written by the target itself through onecat's engine.

A drafter learns to predict the target; so its training text is the target's own answers (DFlash and
EAGLE regenerate the dataset's replies with the target), mostly greedy, which is what greedy
speculation verifies, and a share sampled (temperature/top_p) so sampled serving is covered too.
Prompts go through the target's chat template and are fed to the engine as a stream (at most a few
batches waiting), so the engine batches freely and a deadline stops the phase cleanly: unfinished
requests keep what they generated so far.
"""
from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from onecat.engine import SamplingParams
from onecat.engine.errors import ConfigError

MIN_RESPONSE_TOKENS = 2  # shorter responses hold no block to learn from


@dataclass(frozen=True)
class Sample:
    """One training sequence: the templated prompt's tokens and the target's response tokens."""

    prompt_ids: list[int]
    response_ids: list[int]
    sampled: bool  # answered by sampling (else greedy)
    finished: bool  # the response ended (stop token or max_new_tokens), not cut by the deadline
    prompt_index: int = -1  # which prompt (its place in the run's prompt list; -1: not recorded)
    answer: int = 0  # which of the prompt's answers: 0 its first, 1.. its extra sampled ones

    @property
    def key(self) -> tuple[int, int]:
        return self.prompt_index, self.answer

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids


def chat_prompt_ids(llm, text: str) -> list[int]:
    """The prompt as the target sees it in a chat: its template around one user turn."""
    rendered = llm.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return llm.tokenizer.encode(rendered, add_special_tokens=False)


def regenerate(llm, prompts: list[str], *, max_new_tokens: int, sampled_fraction: float, temperature: float,
               top_p: float, seed: int, extra_sampled_answers: int = 0, deadline: float | None = None,
               done: set[tuple[int, int]] = frozenset(), log: Callable[[str], None] = print
               ) -> tuple[list[Sample], dict]:
    """The target's responses to `prompts` (greedy first, then the sampled ones, each its own phase so
    the greedy phase keeps the engine's fast all-greedy decode path); and counts for the record. Each
    prompt gets one answer (greedy, or sampled for the `sampled_fraction` share) and `extra_sampled_answers`
    more, sampled with seeds of their own: more of the target's own text per prompt, as DFlash's and EAGLE's
    regenerated sets have. Answers whose (prompt index, answer) key is in `done` are skipped, so a run cut by
    its deadline is continued by the next one; `stats["complete"]` says whether every answer now exists whole
    (none cut by the deadline)."""
    room = llm.max_model_len - max_new_tokens
    encoded = [chat_prompt_ids(llm, p) for p in prompts]
    keep = [i for i, ids in enumerate(encoded) if len(ids) < room]
    if not keep:
        raise ConfigError(f"no prompt fits max_model_len {llm.max_model_len} with max_new_tokens {max_new_tokens}")
    rng = random.Random(seed)
    n_sampled = round(sampled_fraction * len(keep))
    sampled = set(rng.sample(keep, n_sampled))
    greedy_params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    jobs = [_Job(i, 0, encoded[i], greedy_params, False) for i in keep if i not in sampled]
    jobs += [_Job(i, 0, encoded[i], SamplingParams(temperature=temperature, top_p=top_p, seed=seed * 1_000_003 + i,
                                                   max_tokens=max_new_tokens), True) for i in sorted(sampled)]
    jobs += [_Job(i, extra, encoded[i], SamplingParams(temperature=temperature, top_p=top_p,
                                                       seed=(seed * 1_000_003 + i) * 131 + extra,
                                                       max_tokens=max_new_tokens), True)
             for extra in range(1, extra_sampled_answers + 1) for i in keep]
    total = len(jobs)
    jobs = [j for j in jobs if (j.prompt_index, j.answer) not in done]
    if done:
        log(f"[regen] continuing: {total - len(jobs)} of {total} answers exist, {len(jobs)} to go")
    t0 = time.perf_counter()
    steps0, prefill0 = llm.engine.stats["steps"], llm.engine.stats["prefill_steps"]
    samples: list[Sample] = []
    not_started = 0
    phases = [[j for j in jobs if not j.sampled], [j for j in jobs if j.sampled]]
    for phase_index, phase in enumerate(phases):
        if not phase:
            continue
        phase_deadline = deadline
        if deadline is not None and phase_index == 0 and phases[1]:  # leave the sampled phase its share
            phase_deadline = time.perf_counter() + (deadline - time.perf_counter()) * len(phase) / len(jobs)
        got, left = _run_phase(llm, phase, phase_deadline, log, "sampled" if phase_index else "greedy")
        samples += got
        not_started += left
    seconds = time.perf_counter() - t0
    response_tokens = sum(len(s.response_ids) for s in samples)
    stats = {"prompts": len(prompts), "too_long_for_context": len(prompts) - len(keep), "answers_asked": total,
             "answers_existing": total - len(jobs), "sequences": len(samples),
             "sampled_sequences": sum(s.sampled for s in samples),
             "cut_by_deadline": sum(not s.finished for s in samples),
             "not_started_by_deadline": not_started,
             "complete": not_started == 0 and all(s.finished for s in samples),
             "prompt_tokens": sum(len(s.prompt_ids) for s in samples), "response_tokens": response_tokens,
             "engine_steps": llm.engine.stats["steps"] - steps0,
             "steps_with_prompt_rows": llm.engine.stats["prefill_steps"] - prefill0,
             "admission_wave": llm.cfg.admission_wave,
             "seconds": round(seconds, 2), "response_tokens_per_s": round(response_tokens / max(seconds, 1e-9), 1)}
    return samples, stats


def unique_answers(samples: list[Sample]) -> tuple[list[Sample], int]:
    """The samples less those that repeat an earlier answer to the same prompt exactly (near-greedy sampling
    repeats the greedy answer): (kept, how many were dropped). Training on a repeat only weights it twice."""
    seen: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
    kept = []
    for s in samples:
        key = (tuple(s.prompt_ids), tuple(s.response_ids))
        if key not in seen:
            seen.add(key)
            kept.append(s)
    return kept, len(samples) - len(kept)


@dataclass(frozen=True)
class _Job:
    prompt_index: int
    answer: int
    ids: list[int]
    params: SamplingParams
    sampled: bool


def _run_phase(llm, jobs: list, deadline: float | None, log: Callable[[str], None], name: str
               ) -> tuple[list[Sample], int]:
    """Run `jobs` through the engine until done or the deadline; (samples, jobs left without an answer by the
    deadline). All are queued at once: the engine's scheduler keeps max_num_seqs of them decoding together."""
    core = llm.engine
    rids = [llm.add_request({"prompt_token_ids": j.ids}, j.params, add_special_tokens=False) for j in jobs]
    t0 = last_log = time.perf_counter()
    tokens0, steps0, prefill0 = (core.stats[k] for k in ("generation_tokens", "steps", "prefill_steps"))
    while core.has_unfinished():
        now = time.perf_counter()
        if deadline is not None and now >= deadline:
            log(f"[regen] {name}: time budget reached; unfinished responses keep what they have")
            break
        core.step()
        if now - last_log >= 10:
            last_log = now
            tokens = core.stats["generation_tokens"] - tokens0
            log(f"[regen] {name}: {tokens} response tokens, {tokens / (now - t0):.0f} tok/s")
    samples, not_started = [], 0
    for rid, job in zip(rids, jobs):
        out = core.pop_output(rid)  # an unfinished request is aborted: what it generated stays
        finished = out.finish_reason in ("stop", "length")
        if out.error or len(out.token_ids) < MIN_RESPONSE_TOKENS:
            not_started += not finished  # a too-short answer the deadline cut is asked again; a finished one is not
            continue
        samples.append(Sample(list(job.ids), list(out.token_ids), job.sampled, finished, job.prompt_index,
                              job.answer))
    log(f"[regen] {name}: {len(samples)} sequences, {sum(len(s.response_ids) for s in samples)} response tokens "
        f"in {time.perf_counter() - t0:.1f} s, {core.stats['steps'] - steps0} steps "
        f"({core.stats['prefill_steps'] - prefill0} with prompt rows)")
    return samples, not_started
