"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`, `.chat(...)`, `.score(...)`.

An LLM validates its settings, has a Worker load the model (engine/worker/), builds the speculative
proposer when one is configured, and hands both to the EngineCore (engine/core/), which runs requests.
"""
from __future__ import annotations

import gc
import itertools
import platform
import time
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from contextlib import AbstractContextManager, contextmanager

import torch

from onecat.engine.args import EngineArgs
from onecat.engine.core.engine_core import EngineCore
from onecat.engine.errors import ConfigError
from onecat.engine.kernels import triton_builds
from onecat.engine.outputs import RequestOutput, ScoreOutput
from onecat.engine.sampling_params import InvalidRequestError, SamplingParams
from onecat.engine.speculative import build_proposer
from onecat.engine.speculative.base import Proposer, SpeculativeDecoder
from onecat.engine.speculative.controller import SpeculationGate
from onecat.engine.worker.worker import Worker


class LLM:
    """An engine over one model. `LLM(model, **settings)` takes exactly EngineArgs' names (engine/args.py):
    a bad or unknown setting, or one the engine does not implement, is a ConfigError saying what to use."""

    def __init__(self, model: str, **settings):
        t0 = time.perf_counter()
        args = EngineArgs.create(model=model, **settings)
        unsupported = args.unsupported()
        if unsupported:
            raise ConfigError("; ".join(unsupported))
        self.worker = w = Worker(args)  # loads the model, sizes its caches, starts the tensor-parallel ranks
        self.cfg, self.source, self.tp = w.cfg, w.source, w.tp  # cfg: the settings as run for this model
        self.model_config, self.tokenizer, self.max_model_len = w.model_config, w.tokenizer, w.max_model_len
        self.device, self.dtype = w.device, w.dtype
        self.engine = EngineCore(self.cfg, w, self._build_proposer())
        self._ids = itertools.count()
        self.warmup = None  # on CUDA: kernels compiled and graphs captured now, not on a request
        self._builds_from = None  # Triton kernel variants counted from here: those built on a request's step
        if self.device.type == "cuda":
            counting = triton_builds.install()
            start = triton_builds.mark()
            self.warmup = w.warm_up(self.engine_generate, self.engine.reset_counters)
            if counting:
                self.warmup["kernel_variants_built"] = triton_builds.mark() - start
                self._builds_from = triton_builds.mark()
        self.load_time_s = time.perf_counter() - t0

    def _build_proposer(self) -> SpeculativeDecoder | None:
        spec = self.cfg.speculative_config
        if spec is None:
            return None
        proposer = build_proposer(spec, self.worker, open_draft_engine=LLM)
        self.worker.setup_verify(proposer.k, spec.exact_batch1, proposer.trims_drafts)
        return proposer

    @property
    def model(self) -> torch.nn.Module | None:
        """The loaded model (None after close())."""
        return self.worker.model

    # ---- requests -----------------------------------------------------------------------------
    def tokenize(self, prompt, add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids) of a prompt: a string, a list of token ids, or
        {"prompt_token_ids": [...], "prompt": optional text}."""
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, Seq) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise InvalidRequestError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def add_request(self, prompt, params: SamplingParams, request_id: str | None = None,
                    add_special_tokens: bool = True, arrival_time: float | None = None) -> str:
        """Tokenize a prompt and hand it to the engine core; returns the request id. A request the engine
        refuses raises InvalidRequestError (nothing is kept for it)."""
        text, ids = self.tokenize(prompt, add_special_tokens)
        rid = request_id or str(next(self._ids))
        self.engine.add_request(rid, text, ids, params, arrival_time)
        return rid

    def engine_generate(self, token_ids: list[list[int]], params: list[SamplingParams]) -> list[RequestOutput]:
        """Generate from token ids with no output post-processing (used by draft engines)."""
        return self._run(token_ids, params, add_special_tokens=False)

    def _run(self, prompts, params, add_special_tokens: bool) -> list[RequestOutput]:
        if self.engine is None:
            raise RuntimeError("this LLM was closed (close() released its weights and KV cache); open a new one")
        if isinstance(prompts, str) or (isinstance(prompts, Seq) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise InvalidRequestError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        tokenized = [self.tokenize(p, add_special_tokens) for p in prompts]  # a bad prompt fails the call first
        refused: dict[str, RequestOutput] = {}
        rids = []
        for (text, ids), sp in zip(tokenized, params_list):
            rid = str(next(self._ids))
            try:
                self.engine.add_request(rid, text, ids, sp)
            except InvalidRequestError as exc:  # this prompt fails alone; the others still run
                refused[rid] = RequestOutput.refused(rid, text, ids, str(exc))
            rids.append(rid)
        try:
            while self.engine.has_unfinished():
                self.engine.step()
            return [refused[rid] if rid in refused else self.engine.pop_output(rid) for rid in rids]
        finally:
            for rid in rids:  # after a failed step too: nothing of this call stays in the engine
                self.engine.release(rid)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        return self._run(prompts, sampling_params, add_special_tokens=True)

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             **template_kwargs) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.tokenizer.apply_chat_template(m, add_generation_prompt=True, **template_kwargs)
                   for m in conversations]
        return self._run(prompts, sampling_params, add_special_tokens=False)

    def score(self, prompts) -> list[ScoreOutput]:
        params = SamplingParams(temperature=0.0, max_tokens=0, prompt_logprobs=0)
        outs = self._run(prompts, params, add_special_tokens=True)
        result = []
        for o in outs:
            if o.error:
                raise InvalidRequestError(o.error)
            result.append(ScoreOutput(o.prompt_token_ids, [float(x) for x in o.prompt_logprobs[1:]]))
        return result

    # ---- introspection ------------------------------------------------------------------------
    def info(self) -> dict:
        """The effective settings and fast paths, for the harness's records."""
        dev = self.device
        hw = (torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or platform.machine())
        return {
            "engine": "onecat", "model_source": self.source.source, "model_path": str(self.source.path),
            "model_format": self.source.format, "architecture": self.model_config.architecture,
            "device": str(dev), "device_name": hw, "dtype": str(self.dtype).replace("torch.", ""),
            "kv_cache_dtype": self.cfg.kv_cache_dtype, "block_size": self.cfg.block_size,
            "num_kv_blocks": self.engine.blocks.num_blocks, "max_model_len": self.max_model_len,
            "max_num_seqs": self.cfg.max_num_seqs, "max_num_batched_tokens": self.cfg.max_num_batched_tokens,
            "admission_wave": self.cfg.admission_wave,
            "enable_prefix_caching": self.cfg.enable_prefix_caching, "quantization": self.worker.packing,
            "fused_kernels": self.worker.fused_kernels["used"], "fused_kernels_detail": self.worker.fused_kernels,
            "async_scheduling": {"enabled": self.cfg.async_scheduling,
                                 "launches": self.engine.pipeline.launches if self.engine.pipeline else 0,
                                 "sampling_graphs": (self.engine.pipeline.sampler_graphs.describe()
                                                     if self.engine.pipeline else None)},
            "attention_backend": self.worker.attention.report(),
            "cuda_graph": self.worker.cuda_graph_report()["used"], "warmup": self.warmup,
            "kernel_variants_built_after_warmup": (triton_builds.describe(self._builds_from)
                                                   if self._builds_from is not None else None),
            "speculative": self.engine.proposer.describe() if self.engine.proposer else None,
            "tensor_parallel": self.tp.describe(self.model_config) if self.tp else None,
            "torch": torch.__version__, "cuda": torch.version.cuda, "threads": torch.get_num_threads(),
            "cpu_threads": self.worker.cpu_threads, "cpu_isa": self._cpu_isa() if dev.type == "cpu" else None,
        }

    def _cpu_isa(self) -> dict:
        """The CPU instruction sets the computation uses: torch's kernels dispatch on its CPU capability, the
        C++ CPU ops (engine/kernels/cpu_ops.py) are compiled for theirs, float32 layers run on the rows kernel or
        oneDNN (engine/kernels/f32_rows.py), and packed 4-bit layers run their
        many-row steps on int8 dot products (AVX512-VNNI or AVX2) where they can (engine/quant/int4/int8_matmul.py)."""
        from onecat.engine.kernels import f32_rows
        from onecat.engine.kernels.cpu_ops import vector_isa

        isa = {"torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu_ops": vector_isa(),
               "float32_matmul": "oneDNN blocked GEMM" if f32_rows.unavailable_reason() else "rows kernel (AVX2 + FMA)"}
        model = self.worker.model
        int8 = sum(1 for m in model.modules() if getattr(m, "int8", None) is not None) if model is not None else 0
        if int8:
            from onecat.engine.quant.int4.int8_matmul import isa as int8_isa

            isa["int8_matmul"] = f"{int8_isa()} ({int8} packed layers)"
        return isa

    def down_reason(self) -> str | None:
        """Why this engine can no longer run a step (a tensor-parallel rank died, or it was closed); None
        while it can. For health probes: reads process states only, from any thread."""
        if self.engine is None:
            return "the engine was closed"
        runner = getattr(self.worker, "runner", None)
        peers = runner.peers if runner is not None else None
        return peers.down_reason() if peers is not None else None

    # ---- CUDA graphs, for measurements that change the model after load -------------------------
    def setup_cuda_graphs(self) -> None:
        """Decode steps replay CUDA graphs from now on, as with cuda_graph full (fresh graphs, captured on
        first use); nothing changes off CUDA."""
        self.worker.setup_cuda_graphs(True)

    def cuda_graph_report(self) -> dict:
        """Whether steps replayed graphs, how often, the captured batch sizes and why graphs are off."""
        return self.worker.cuda_graph_report()

    def cuda_graphs_replaced(self, enabled: bool) -> AbstractContextManager[None]:
        """A context manager: steps inside it run on fresh CUDA graphs (`enabled`) or eagerly; afterwards
        the engine's own graphs, with what they captured, are back."""
        return self.worker.graphs_replaced(enabled)

    # ---- a proposer of the caller's, for measurements -----------------------------------------
    @contextmanager
    def proposer_swapped(self, proposer: Proposer, gate: SpeculationGate | None = None,
                         exact_batch1: bool = False) -> Iterator[None]:
        """Requests inside the block decode with `proposer` behind the engine's exact verifier (e.g. a
        benchmark's acceptance-controlled proposer, speculative/synthetic.py), with `gate` deciding when to
        draft (none: every step) and `exact_batch1` as the speculative setting of that name; afterwards the
        engine's own proposer and verify settings are back."""
        own = self.engine.proposer
        decoder = SpeculativeDecoder(proposer, self.max_model_len, gate)
        self.worker.setup_verify(proposer.k, exact_batch1, decoder.trims_drafts)
        try:
            with self.engine.proposer_swapped(decoder):
                yield
        finally:
            if own is not None:
                self.worker.setup_verify(own.k, self.cfg.speculative_config.exact_batch1, own.trims_drafts)

    def close(self) -> None:
        """Releases the model weights and the KV cache now (not whenever the garbage collector gets to the
        engine's reference cycles) and stops the other tensor-parallel ranks; the object cannot generate
        afterwards. Safe to call twice."""
        self.worker.close()
        self.engine = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
