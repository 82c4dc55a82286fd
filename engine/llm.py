"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`, `.chat(...)`, `.score(...)`."""
from __future__ import annotations

import gc
import itertools
import platform
import time
from collections.abc import Sequence as Seq

import torch

from onecat.engine.args import EngineArgs
from onecat.engine.config import cpu_kv_cache_budget_gb, parse_dtype, parse_kv_cache_dtype, resolve_device
from onecat.engine.engine_core import EngineCore
from onecat.engine.errors import ConfigError
from onecat.engine.kv_cache import bytes_per_block
from onecat.engine.layers.linear import pack_weights
from onecat.engine.layers.rotary import RotaryEmbedding
from onecat.engine.loader import open_checkpoint
from onecat.engine.loader.dummy import fill_random_weights
from onecat.engine.model_source import resolve_model_source
from onecat.engine.models.registry import model_class
from onecat.engine.models.support import effective_settings, num_state_snapshots, unsupported_settings
from onecat.engine.quant import WeightPacker, check_quantization
from onecat.engine.quant.w4a16_packer import W4A16_NAMES, W4A16Packer
from onecat.engine.outputs import RequestOutput, ScoreOutput
from onecat.engine.sampling_params import InvalidRequestError, SamplingParams
from onecat.engine.warmup import warm_up

class LLM:
    """An engine over one model. `LLM(model, **settings)` takes exactly EngineArgs' names (engine/args.py):
    a bad or unknown setting, or one the engine does not implement, is a ConfigError saying what to use."""

    def __init__(self, model: str, **settings):
        t0 = time.perf_counter()
        self.cfg = EngineArgs.create(model=model, **settings)
        unsupported = self.cfg.unsupported()
        if unsupported:
            raise ConfigError("; ".join(unsupported))
        self.source = resolve_model_source(model, self.cfg.revision, weights_required=self.cfg.load_format != "dummy")
        self.device = resolve_device(self.cfg.device)
        self.tp = None  # tensor parallel: this process's rank (engine/parallel)
        if self.cfg.tensor_parallel_size > 1:
            from onecat.engine.parallel.tensor_parallel import TensorParallel

            self.tp = TensorParallel(self.cfg.tensor_parallel_size, self.device,
                                     peer_collectives=not self.cfg.disable_custom_all_reduce)
            self.device = self.tp.device
        self.cpu_threads = None  # CPU, one rank: how many intra-op threads, and why (engine/cpu_threads.py)
        if self.cfg.cpu_threads is not None and (self.device.type != "cpu" or self.tp is not None):
            where = "tensor parallel ranks (each takes its share of the cores)" if self.tp else f"device {self.device}"
            raise ConfigError(f"cpu_threads sets the threads of a CPU engine of one rank, not of {where}; "
                              "remove cpu_threads")
        if self.device.type == "cpu" and self.tp is None:
            from onecat.engine.cpu_threads import choose_cpu_threads

            self.cpu_threads = choose_cpu_threads(self.cfg.cpu_threads)
        check_quantization(self.cfg.quantization, self.source.format, self.device)
        self.w4a16 = W4A16Packer(self.cfg.quantization) if self.cfg.quantization in W4A16_NAMES else None
        ckpt = open_checkpoint(self.source, keep_quantized=self.cfg.quantization == "gguf",
                               on_quantized=self.w4a16.keep if self.w4a16 else None)
        self.model_config, self.tokenizer = ckpt.config, ckpt.tokenizer
        self.dtype = parse_dtype(self.cfg.dtype, self.device, self.model_config.torch_dtype)
        unsupported = unsupported_settings(self.cfg, self.model_config, self.device)
        if unsupported:
            raise ConfigError("; ".join(unsupported))
        self.cfg = effective_settings(self.cfg, self.model_config)
        # for info(): what GGUF packing did, or the quantized HF format that was read dequantized
        self.packing: dict | None = None if ckpt.stored_as is None else {
            "checkpoint": ckpt.stored_as, "dequantized_to": str(self.dtype).replace("torch.", "")}
        limit = self.model_config.max_position_embeddings
        self.max_model_len = self.cfg.max_model_len or limit
        if self.max_model_len > limit and not self.model_config.rope_scaling:
            raise ConfigError(f"max_model_len={self.max_model_len} exceeds the model's {limit} positions")
        self.model = self._build_model(ckpt)
        self.fused_kernels = self._enable_fused_kernels(self.cfg.fused_kernels)
        fp8 = parse_kv_cache_dtype(self.cfg.kv_cache_dtype)
        kv_config = self.tp.kv_config(self.model_config) if self.tp else self.model_config
        num_blocks = self._num_kv_blocks(fp8 is not None, kv_config)
        torch.manual_seed(self.cfg.seed)
        self.engine = EngineCore(self.model, kv_config, self.tokenizer, self.cfg, self.max_model_len,
                                 num_blocks, self.dtype, fp8, self.device)
        self.engine.runner.setup_cuda_graphs(self.cfg.cuda_graph == "full", self.max_model_len, self.cfg.max_num_seqs)
        if self.tp is not None:
            self.engine.runner.collectives = self.tp.collectives
            if self.tp.is_worker:
                return  # a worker rank runs the steps rank 0 sends it (engine/parallel/runtime.py)
            self.engine.runner.peers = self.tp.start_workers(type(self), model, settings, num_blocks)
        spec = self.cfg.speculative_config
        speculative_config = spec.model_dump(exclude_none=True) if spec is not None else None
        if speculative_config:
            from onecat.engine.speculative import build_proposer

            self.engine.proposer = build_proposer(speculative_config, self, open_draft_engine=LLM)
            self.engine.runner.setup_verify(1 + self.engine.proposer.k,
                                            self.fused_kernels["used"] and self.fused_kernels["kind"] == "triton")
        self._ids = itertools.count()
        self.warmup = warm_up(self) if self.device.type == "cuda" else None  # compile now, not on a request
        self.load_time_s = time.perf_counter() - t0

    # ---- construction -------------------------------------------------------------------------
    def _build_model(self, ckpt) -> torch.nn.Module:
        cls = model_class(self.model_config.architecture)
        with torch.device("meta"):
            model = cls(self.model_config, self.max_model_len)
        loader = None
        if self.tp is not None:  # sharded on meta: a rank allocates and loads only its share
            spec = self.cfg.speculative_config
            loader = self.tp.shard(model, keep_full_vocab=spec is not None and spec.method == "dflash")
        model = model.to_empty(device=self.device).to(self.dtype)
        for m in model.modules():
            if isinstance(m, RotaryEmbedding):
                m.build_tables(self.device)
        if self.model_config.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        if self.cfg.quantization == "gguf":
            packer = WeightPacker()
            model.load_weights(packer.intercept(ckpt.weights))
            self.packing = packer.apply(model)
        elif self.cfg.load_format == "dummy":
            fill_random_weights(model, self.cfg.seed)
        else:
            model.load_weights(loader.weights(ckpt.weights) if loader is not None else ckpt.weights)
        if loader is not None:
            self.tp.full_vocab = loader.full_vocab_layers(self.model_config.tie_word_embeddings)
        if self.w4a16 is not None:  # 4-bit linears kept packed (CUDA GEMV kernels; CPU: the int4 layer)
            self.packing = self.w4a16.apply(model)
        if self.device.type == "cpu" and torch.backends.mkldnn.is_available():
            pack_weights(model)
        if hasattr(model, "allocate_recurrent_state"):  # hybrid: one state slot per request that may run at once
            model.allocate_recurrent_state(self.cfg.max_num_seqs, self.dtype, self.device, num_state_snapshots(self.cfg))
        return model.eval()

    def vocab_layers(self) -> tuple[torch.nn.Module, torch.nn.Module]:
        """The target's whole embedding and LM head, for a drafter that calls them outside a step (under
        tensor parallel the model's own are sharded, and rank 0 keeps copies)."""
        if self.tp is not None and self.tp.full_vocab is not None:
            return self.tp.full_vocab
        return self.model.embed_tokens, self.model.lm_head

    def _enable_fused_kernels(self, wanted: bool) -> dict:
        """Fused kernels for the per-layer small ops: Triton on CUDA, the C++ CPU ops (float32) on CPU; the
        reference torch ops where they cannot run, with the reason."""
        if self.device.type == "cuda":
            from onecat.engine.kernels.triton_fused import fused_unavailable_reason

            reason = "turned off (fused_kernels=False)" if not wanted else fused_unavailable_reason()
            for m in self.model.modules():
                if hasattr(type(m), "use_fused"):
                    m.use_fused = reason is None
            return {"used": reason is None, "kind": "triton", "reason": reason}
        from onecat.engine.kernels import cpu_ops

        reason = ("turned off (fused_kernels=False)" if not wanted else
                  f"the CPU fused ops take float32 models; dtype {self.dtype} runs the torch ops"
                  if self.dtype != torch.float32 else cpu_ops.unavailable_reason())
        ops = cpu_ops.load() if reason is None else None
        for m in self.model.modules():
            if hasattr(type(m), "cpu_ops"):
                m.cpu_ops = ops
            # the fused ops after o_proj, gate_up and down_proj read a packed matmul's bf16 output directly
            for name in ("o_proj", "gate_up_proj", "down_proj"):
                if hasattr(getattr(m, name, None), "keep_kernel_output"):
                    getattr(m, name).keep_kernel_output = reason is None
        report = {"used": reason is None, "kind": "cpu", "reason": reason}
        if reason is None and hasattr(type(self.model), "cpu_decode"):
            from onecat.engine.models import llama_cpu_decode

            why_not = llama_cpu_decode.unsupported_reason(self.model)
            self.model.cpu_decode = llama_cpu_decode.CpuDecodeLayers(self.model, ops) if why_not is None else None
            report["one_call_decode"] = why_not or "batch-1 decode steps run all layers in one C++ call"
        return report

    def _num_kv_blocks(self, fp8: bool, mc) -> int:
        c = self.cfg
        per_block = bytes_per_block(len(mc.kv_layer_ids), c.block_size, mc.num_key_value_heads, mc.head_dim,
                                    self.dtype, fp8)
        min_blocks = -(-self.max_model_len // c.block_size) + 1  # + the null block
        if c.num_kv_blocks is not None:
            n = c.num_kv_blocks
        else:
            if c.kv_cache_memory_gb is not None:
                budget = c.kv_cache_memory_gb * 2**30
            elif self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = 0.9 * free
            else:
                wanted = c.max_num_seqs * self.max_model_len * per_block / c.block_size
                budget = min(cpu_kv_cache_budget_gb() * 2**30, max(wanted, min_blocks * per_block))
            n = int(budget // per_block)
        if n < min_blocks:
            raise ConfigError(f"the KV cache holds {n} blocks ({n * c.block_size} tokens) but one request of "
                              f"max_model_len={self.max_model_len} needs {min_blocks}; give more KV memory "
                              "(kv_cache_memory_gb) or lower max_model_len")
        return n

    # ---- requests -----------------------------------------------------------------------------
    def _tokenize(self, prompt, add_special_tokens: bool) -> tuple[str | None, list[int]]:
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
        text, ids = self._tokenize(prompt, add_special_tokens)
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
        tokenized = [self._tokenize(p, add_special_tokens) for p in prompts]  # a bad prompt fails the call first
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
            "enable_prefix_caching": self.cfg.enable_prefix_caching, "quantization": self.packing,
            "fused_kernels": self.fused_kernels["used"], "fused_kernels_detail": self.fused_kernels,
            "async_scheduling": {"enabled": self.cfg.async_scheduling,
                                 "launches": self.engine.pipeline.launches if self.engine.pipeline else 0},
            "attention_backend": self.engine.attention.report(),
            "cuda_graph": self.engine.runner.cuda_graph_report()["used"], "warmup": self.warmup,
            "speculative": self.engine.proposer.describe() if self.engine.proposer else None,
            "tensor_parallel": self.tp.describe(self.model_config) if self.tp else None,
            "torch": torch.__version__, "cuda": torch.version.cuda, "threads": torch.get_num_threads(),
            "cpu_threads": self.cpu_threads,
        }

    def close(self) -> None:
        """Releases the model weights and the KV cache now (not whenever the garbage collector gets to the
        engine's reference cycles) and stops the other tensor-parallel ranks; the object cannot generate
        afterwards. Safe to call twice."""
        if self.tp is not None and not self.tp.is_worker:
            self.tp.close()
        self.engine = None
        self.model = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
