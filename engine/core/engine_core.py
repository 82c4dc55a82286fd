"""The engine core: it alone creates, steps, finishes and forgets requests.

A step is schedule -> run the model (sample or verify) -> post-process. `add_request` checks a
request against the model and refuses a bad one by raising InvalidRequestError before anything
exists for it. Callers read a request through `output(request_id)` and hand it back with
`release(request_id)` (or both at once: `pop_output`).

The core is given everything it works with when it is made: the settings, the worker that loaded the
model and runs each step (interfaces.StepWorker), and the speculative proposer, if any.
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from onecat.engine.config import EngineConfig
from onecat.engine.core.block_manager import BlockManager
from onecat.engine.core.decode_pipeline import DecodePipeline
from onecat.engine.core.interfaces import SpeculativeProposer, StepWorker
from onecat.engine.core.keyed_draws import row_keys
from onecat.engine.core.sampler import apply_filters, apply_logits_processors, sample, token_logprobs
from onecat.engine.core.scheduler import Scheduler
from onecat.engine.core.scheduler_output import ScheduledSeq
from onecat.engine.core.sequence import FeatureRows, Sequence, SequenceUpdate
from onecat.engine.core.step_result import StepResult
from onecat.engine.outputs import RequestOutput, RequestTimings
from onecat.engine.sampling_params import InvalidRequestError, SamplingParams


class EngineCore:
    def __init__(self, cfg: EngineConfig, worker: StepWorker, proposer: SpeculativeProposer | None = None):
        self.cfg, self.worker = cfg, worker
        self.model_cfg, self.tokenizer = worker.model_config, worker.tokenizer
        self.max_model_len, self.device = worker.max_model_len, worker.device
        # the KV blocks (and a hybrid model's state slots) the scheduler hands out
        self.blocks = BlockManager(worker.num_kv_blocks, cfg.block_size, cfg.enable_prefix_caching, worker.states)
        self.scheduler = Scheduler(cfg, self.blocks)
        self.eos_ids = set(self.tokenizer.eos_token_ids)
        self._seqs: dict[str, Sequence] = {}
        self._seed_rng = torch.Generator().manual_seed(cfg.seed)
        self.proposer = proposer  # speculative decoding, when configured
        self.pipeline = DecodePipeline(self) if cfg.async_scheduling else None
        # prefill_steps: steps with prompt rows (eager on CUDA, where pure decode steps may replay graphs)
        self.stats = {"steps": 0, "prefill_steps": 0, "prompt_tokens": 0, "generation_tokens": 0}

    @contextmanager
    def proposer_swapped(self, proposer: SpeculativeProposer | None) -> Iterator[None]:
        """Run the block's steps with `proposer` (e.g. one that records the target's features), then put
        the engine's own proposer back."""
        previous, self.proposer = self.proposer, proposer
        try:
            yield
        finally:
            self.proposer = previous

    # ---- requests -----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | None, token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        """Admit a request, or raise InvalidRequestError saying what to change (nothing is kept then).
        `arrival_time` (perf_counter) backdates the request to when its caller received it."""
        self._check_request(request_id, token_ids, params)
        seq = Sequence(request_id, prompt, token_ids, params, self._request_seed(params.seed))
        if arrival_time is not None:
            seq.arrival_time = min(seq.arrival_time, arrival_time)
        self._seqs[request_id] = seq
        self.scheduler.add(seq)

    def _check_request(self, request_id: str, ids: list[int], params: SamplingParams) -> None:
        if request_id in self._seqs:
            raise InvalidRequestError(f"request id {request_id!r} is already in use; give each request its own id")
        params.validate()
        if not ids:
            raise InvalidRequestError("the prompt is empty; give at least one token")
        vocab = self.model_cfg.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(f"the prompt has {len(ids)} tokens but max_model_len is {self.max_model_len}; "
                                      "shorten the prompt or raise max_model_len")
        for name in ("logprobs", "prompt_logprobs"):  # a top-n beyond the vocabulary would crash the step
            n = getattr(params, name)
            if n is not None and n > vocab:
                raise InvalidRequestError(f"{name}={n} is more than the vocabulary's {vocab} tokens; ask for at "
                                          f"most {vocab}")
        bad = [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab})")

    def _request_seed(self, seed: int | None) -> int:
        """The request's own seed, or one drawn from the engine seed for an unseeded request."""
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_rng))
        return seed

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._seqs

    def abort(self, request_id: str) -> None:
        """Stop a request now (its KV blocks are freed); its output stays readable until released."""
        seq = self._seqs.get(request_id)
        if seq is not None and not seq.is_finished:
            self._finish(seq, "abort")

    def release(self, request_id: str) -> None:
        """Forget a request, aborting it first if it is still running. Unknown ids are ignored."""
        self.abort(request_id)
        self._seqs.pop(request_id, None)

    def output(self, request_id: str) -> RequestOutput:
        """A snapshot of the request so far (final once `finished` is True)."""
        seq = self._seqs.get(request_id)
        if seq is None:
            raise KeyError(f"the engine holds no request {request_id!r} (never added, or already released)")
        return self._make_output(seq)

    def pop_output(self, request_id: str) -> RequestOutput:
        """The request's output, then release it."""
        out = self.output(request_id)
        self.release(request_id)
        return out

    def reset_counters(self) -> None:
        """Back to a fresh engine's counters, seed stream and prefix cache (after the start-up warm-up)."""
        assert not self._seqs, "reset_counters with requests in flight"
        self.stats = dict.fromkeys(self.stats, 0)
        self._seed_rng.manual_seed(self.cfg.seed)
        self.blocks.reset_prefix_cache()
        self.scheduler.num_preemptions = 0
        self.worker.reset_counters()
        if self.pipeline is not None:
            self.pipeline.launches = 0

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step: schedule -> run -> post-process ----------------------------------------------
    def step(self) -> list[str]:
        """Advance every scheduled request by one step; returns the ids of the requests it touched."""
        started = time.perf_counter()
        touched = self.pipeline.step() if self.pipeline is not None else None  # steady greedy decode
        if touched is not None and self.proposer is not None and self.pipeline.applied_batch:
            # a plain step while the gate paused drafting: timed like any other
            self.proposer.step_done(self.pipeline.applied_batch, False, time.perf_counter() - started, 1.0)
        if touched is None:
            scheduled = self._schedule()
            if not scheduled:
                return []
            decoding = self.proposer is not None and all(
                s.num_new_tokens == 1 and s.seq.num_computed_tokens + 1 == s.seq.num_tokens
                and s.seq.num_computed_tokens >= s.seq.num_prompt_tokens for s in scheduled)
            updates = self._run(scheduled)
            touched = self.postprocess(updates)
            if decoding:  # the proposer's gate weighs rounds against plain steps
                self.proposer.step_done(len(scheduled), any(s.num_lookahead for s in scheduled),
                                        time.perf_counter() - started,
                                        sum(len(u.new_tokens) for u in updates) / len(updates))
        return [seq.request_id for seq in touched]

    def _schedule(self) -> list[ScheduledSeq]:
        lookahead = self.proposer.lookahead(self.scheduler.running) if self.proposer is not None else None
        return self.scheduler.schedule(lookahead).scheduled

    def _run(self, scheduled: list[ScheduledSeq]) -> list[SequenceUpdate]:
        """Run the model on the batch; each sequence's new tokens are sampled, verified or (mid-prompt) none."""
        result = self.worker.execute(scheduled)
        sampled = self._sample(scheduled, result)
        wants_features = self.proposer is not None and self.proposer.wants_features  # block drafters
        features = self.proposer.step_features() if wants_features else None
        verified = self._verify(scheduled, result, features)
        updates, row = [], 0
        for i, s in enumerate(scheduled):
            if i in result.prompt_logprobs:
                chunk = result.prompt_logprobs[i]
                s.seq.prompt_logprobs.extend(chunk.values)
                if s.seq.prompt_top_logprobs is not None:
                    s.seq.prompt_top_logprobs.extend(chunk.tops)
                    s.seq.prompt_ranks.extend(chunk.ranks)
            if i in verified:
                new_tokens = verified[i]
                if s.seq.logprobs is not None:  # row j of the verify logits chose new token j
                    n = s.seq.params.logprobs
                    s.seq.logprobs.extend(token_logprobs(result.verify_logits[i], new_tokens, [n] * len(new_tokens)))
            else:
                new_tokens = [sampled[i]] if i in sampled else []
            kept = s.num_new_tokens + max(0, len(new_tokens) - 1)  # accepted drafts keep their KV
            rows = FeatureRows(features, row, kept) if features is not None else None
            updates.append(SequenceUpdate(s.seq, s.num_new_tokens, new_tokens, rows))
            row += s.num_new_tokens + s.num_lookahead
        return updates

    def _verify(self, scheduled: list[ScheduledSeq], result: StepResult,
                features: torch.Tensor | None) -> dict[int, list[int]]:
        """The tokens of every sequence that verified drafts this step (scheduled index -> tokens); a block
        drafter gets each one's tapped rows of the step too (it may draft the next round from them at once)."""
        if not result.verify_logits:
            return {}
        index = list(result.verify_logits)
        spans = None
        if features is not None:
            first = list(itertools.accumulate((s.num_new_tokens + s.num_lookahead for s in scheduled), initial=0))
            spans = [FeatureRows(features, first[i], scheduled[i].num_new_tokens + scheduled[i].num_lookahead)
                     for i in index]
        tokens = self.proposer.verify([(scheduled[i].seq, scheduled[i], result.verify_logits[i]) for i in index],
                                      spans)
        return dict(zip(index, tokens))

    def _sample(self, scheduled: list[ScheduledSeq], result: StepResult) -> dict[int, int]:
        """A token for every sequence that reached its end this step (scheduled index -> token); logprobs
        and, for a draft engine, the sampling distributions are kept on the sequence."""
        if not result.sample_rows:
            return {}
        seqs = [scheduled[i].seq for i in result.sample_rows]
        params = [seq.params for seq in seqs]
        keys = None if all(p.greedy for p in params) else \
            row_keys([seq.seed for seq in seqs], [seq.num_tokens for seq in seqs], result.logits.device)
        tokens = sample(apply_logits_processors(result.logits, seqs), params, keys)
        if any(p.logprobs is not None for p in params):
            for seq, lp in zip(seqs, token_logprobs(result.logits, tokens, [p.logprobs for p in params])):
                if lp is not None:
                    seq.logprobs.append(lp)
        keep = [j for j, p in enumerate(params) if p.keep_probs]
        if keep:  # a drafting engine hands its distributions q to the verifier
            probs = apply_filters(result.logits[keep].float(), [params[j] for j in keep])
            for j, row in zip(keep, probs):
                seqs[j].kept_probs.append(row)
        return dict(zip(result.sample_rows, tokens))

    def postprocess(self, updates: list[SequenceUpdate]) -> list[Sequence]:
        """Apply one step's results: advance the KV, append tokens, check stops, publish full blocks to
        the prefix cache and hand block drafters their features. Serves the plain step and the
        one-step-ahead pipeline alike; returns the sequences whose output changed or that finished."""
        self.stats["steps"] += 1
        now = time.perf_counter()
        touched = []
        prefill = False
        for u in updates:
            seq = u.seq
            seq.num_computed_tokens += u.num_new_tokens
            if seq.num_computed_tokens <= seq.num_prompt_tokens:
                self.stats["prompt_tokens"] += u.num_new_tokens
                prefill = True
            if not u.new_tokens:  # a prefill chunk that did not reach the end of the prompt
                self._keep_computed(seq, u.features)
                continue
            seq.num_computed_tokens += len(u.new_tokens) - 1  # accepted drafts' KV is already written
            if seq.first_token_time is None:
                seq.first_token_time = now
            if seq.params.max_tokens == 0:  # scoring only: the prompt's logprobs are the result
                self.blocks.register_computed(seq)
                self._finish(seq, "length")
            else:
                for tok in u.new_tokens:
                    seq.token_ids.append(tok)
                    self.stats["generation_tokens"] += 1
                    if self._check_stop(seq, tok):
                        break
                if not seq.is_finished:
                    self._keep_computed(seq, u.features)
            touched.append(seq)
        self.stats["prefill_steps"] += prefill
        return touched

    def _keep_computed(self, seq: Sequence, features: FeatureRows | None) -> None:
        self.blocks.register_computed(seq)
        if features is not None:
            self.proposer.record_features(seq, features)

    def _finish(self, seq: Sequence, reason: str, stop_reason=None) -> None:
        self.scheduler.finish(seq, reason, stop_reason)
        if self.proposer is not None:
            self.proposer.release(seq)

    def _check_stop(self, seq: Sequence, tok: int) -> bool:
        p = seq.params
        n_out = seq.num_output_tokens
        if n_out >= p.min_tokens:
            if (tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids:
                self._finish(seq, "stop", tok)
                return True
            if p.stop:
                text = self.tokenizer.decode(seq.output_token_ids, p.skip_special_tokens)
                tail_from = max(0, len(text) - max(len(s) for s in p.stop) - 16)
                for s in p.stop:
                    at = text.find(s, tail_from)
                    if at >= 0:
                        seq.text = text[:at + (len(s) if p.include_stop_str_in_output else 0)]
                        self._finish(seq, "stop", s)
                        return True
        if (p.max_tokens is not None and n_out >= p.max_tokens) or seq.num_tokens >= self.max_model_len:
            self._finish(seq, "length")
            return True
        return False

    # ---- outputs ------------------------------------------------------------------------------
    def _make_output(self, seq: Sequence) -> RequestOutput:
        fin = seq.is_finished
        text = seq.text if (fin and seq.finish_reason == "stop" and isinstance(seq.stop_reason, str)) else \
            self.tokenizer.decode(seq.output_token_ids, seq.params.skip_special_tokens)
        t0 = seq.arrival_time
        first_sched = seq.first_scheduled_time or t0
        first_tok = seq.first_token_time or first_sched
        end = seq.finish_time or time.perf_counter()
        timings = RequestTimings(queue_s=first_sched - t0, prefill_s=first_tok - first_sched,
                                 first_token_s=first_tok - t0, decode_s=end - first_tok if seq.first_token_time else 0.0,
                                 e2e_s=end - t0)
        return RequestOutput(
            request_id=seq.request_id, prompt=seq.prompt, prompt_token_ids=seq.token_ids[:seq.num_prompt_tokens],
            token_ids=seq.output_token_ids, text=text, finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
            logprobs=seq.logprobs, prompt_logprobs=seq.prompt_logprobs, prompt_top_logprobs=seq.prompt_top_logprobs,
            prompt_ranks=seq.prompt_ranks, num_cached_tokens=seq.num_cached_tokens,
            timings=timings, spec=seq.spec, finished=fin,
            probs=torch.stack(seq.kept_probs) if seq.kept_probs else None)
