"""The engine step loop: schedule -> run the model -> sample -> update sequences -> outputs."""
from __future__ import annotations

import time

import torch

from onecat.engine.attention.selector import AttentionDispatcher
from onecat.engine.block_manager import BlockManager
from onecat.engine.config import EngineConfig, ModelConfig
from onecat.engine.decode_pipeline import DecodePipeline
from onecat.engine.kv_cache import allocate_kv_caches
from onecat.engine.model_runner import ModelRunner
from onecat.engine.outputs import RequestOutput, RequestTimings
from onecat.engine.sampler import apply_filters, apply_logits_processors, sample, token_logprobs
from onecat.engine.scheduler import Scheduler
from onecat.engine.sequence import Sequence
from onecat.engine.tokenizer import Tokenizer


class EngineCore:
    def __init__(self, model: torch.nn.Module, model_cfg: ModelConfig, tokenizer: Tokenizer, cfg: EngineConfig,
                 max_model_len: int, num_blocks: int, dtype: torch.dtype, fp8_dtype: torch.dtype | None,
                 device: torch.device):
        self.cfg, self.model_cfg, self.tokenizer = cfg, model_cfg, tokenizer
        self.max_model_len, self.device = max_model_len, device
        self.blocks = BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(cfg, self.blocks)
        self.attention = AttentionDispatcher(cfg.attention_backend, device)
        caches = allocate_kv_caches(model_cfg.num_hidden_layers, num_blocks, cfg.block_size,
                                    model_cfg.num_key_value_heads, model_cfg.head_dim, dtype, fp8_dtype, device)
        self.runner = ModelRunner(model, caches, self.attention, cfg.block_size, device)
        self.eos_ids = set(tokenizer.eos_token_ids)
        self.seqs: dict[str, Sequence] = {}
        self._seed_rng = torch.Generator().manual_seed(cfg.seed)
        self.proposer = None  # speculative proposer, when configured
        self.pipeline = DecodePipeline(self) if cfg.async_scheduling else None
        self.stats = {"steps": 0, "prompt_tokens": 0, "generation_tokens": 0}

    # ---- requests -----------------------------------------------------------------------------
    def make_generator(self, seed: int | None) -> torch.Generator:
        if seed is None:  # unseeded requests still get their own stream, drawn from the engine seed
            seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_rng))
        return torch.Generator(device=self.device).manual_seed(seed)

    def add_request(self, seq: Sequence) -> None:
        self.seqs[seq.request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> None:
        seq = self.seqs.get(request_id)
        if seq is not None and not seq.is_finished:
            self.finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step -----------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Advance every scheduled sequence by one step; returns the sequences touched this step."""
        if self.pipeline is not None:
            touched = self.pipeline.step()  # steady greedy decode on CUDA graphs: one step ahead
            if touched is not None:
                return touched
        lookahead = self.proposer.lookahead(self.scheduler.running) if self.proposer else None
        out = self.scheduler.schedule(lookahead)
        if not out.scheduled:
            return []
        result = self.runner.execute(out.scheduled)
        self.stats["steps"] += 1
        now = time.perf_counter()
        sampled: dict[int, int] = {}
        if result.sample_rows:
            idx = result.sample_rows
            seqs = [out.scheduled[i].seq for i in idx]
            logits = apply_logits_processors(result.logits, seqs)
            toks = sample(logits, [s.params for s in seqs], [s.generator for s in seqs])
            lps = token_logprobs(result.logits, toks, [s.params.logprobs for s in seqs]) \
                if any(s.params.logprobs is not None for s in seqs) else [None] * len(seqs)
            for i, tok, lp in zip(idx, toks, lps):
                sampled[i] = tok
                if lp is not None:
                    out.scheduled[i].seq.logprobs.append(lp)
            keep = [j for j, s in enumerate(seqs) if s.params.extra.get("keep_probs")]
            if keep:  # a drafting engine hands its distributions q to the verifier
                probs = apply_filters(result.logits[keep].float(), [seqs[j].params for j in keep])
                for j, row in zip(keep, probs):
                    seqs[j].kept_probs.append(row)
        touched = []
        aux = getattr(self.runner.model, "aux_hidden", None)
        starts = [0]
        for s in out.scheduled:
            starts.append(starts[-1] + s.num_new_tokens + s.num_lookahead)
        for i, s in enumerate(out.scheduled):
            seq = s.seq
            computed_before = seq.num_computed_tokens
            if i in result.prompt_logprobs:
                seq.prompt_logprobs.extend(result.prompt_logprobs[i])
            seq.num_computed_tokens += s.num_new_tokens
            if seq.num_computed_tokens <= seq.num_prompt_tokens:
                self.stats["prompt_tokens"] += s.num_new_tokens
            if i in result.verify_logits:
                new_tokens = self.proposer.verify(seq, s, result.verify_logits[i])
                seq.num_computed_tokens += len(new_tokens) - 1  # accepted drafts' KV is already written
            elif i in sampled:
                new_tokens = [sampled[i]]
            else:
                self.blocks.register_computed(seq)
                self._record_features(seq, aux, starts[i], computed_before)
                continue  # a prefill chunk that did not reach the end of the prompt
            if seq.first_token_time is None:
                seq.first_token_time = now
            if seq.params.max_tokens == 0:
                self.blocks.register_computed(seq)
                self.finish(seq, "length")
                touched.append(seq)
                continue
            for tok in new_tokens:
                seq.token_ids.append(tok)
                self.stats["generation_tokens"] += 1
                if self.check_stop(seq, tok):
                    break
            if not seq.is_finished:
                self.blocks.register_computed(seq)
                self._record_features(seq, aux, starts[i], computed_before)
            touched.append(seq)
        return touched

    def _record_features(self, seq: Sequence, aux, start: int, computed_before: int) -> None:
        if aux is not None and hasattr(self.proposer, "proposer") and hasattr(self.proposer.proposer, "record_features"):
            kept = seq.num_computed_tokens - computed_before
            self.proposer.proposer.record_features(seq, aux[start:start + kept])

    def finish(self, seq: Sequence, reason: str, stop_reason=None) -> None:
        self.scheduler.finish(seq, reason, stop_reason)
        if self.proposer is not None:
            self.proposer.release(seq)

    def check_stop(self, seq: Sequence, tok: int) -> bool:
        p = seq.params
        n_out = seq.num_output_tokens
        if n_out >= p.min_tokens:
            if (tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids:
                self.finish(seq, "stop", tok)
                return True
            if p.stop:
                text = self.tokenizer.decode(seq.output_token_ids, p.skip_special_tokens)
                tail_from = max(0, len(text) - max(len(s) for s in p.stop) - 16)
                for s in p.stop:
                    at = text.find(s, tail_from)
                    if at >= 0:
                        seq.text = text[:at + (len(s) if p.include_stop_str_in_output else 0)]
                        self.finish(seq, "stop", s)
                        return True
        if (p.max_tokens is not None and n_out >= p.max_tokens) or seq.num_tokens >= self.max_model_len:
            self.finish(seq, "length")
            return True
        return False

    # ---- outputs ------------------------------------------------------------------------------
    def make_output(self, seq: Sequence) -> RequestOutput:
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
            logprobs=seq.logprobs, prompt_logprobs=seq.prompt_logprobs, num_cached_tokens=seq.num_cached_tokens,
            timings=timings, spec=seq.spec, finished=fin,
            probs=torch.stack(seq.kept_probs) if seq.kept_probs else None)
