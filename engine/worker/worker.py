"""The model side of an engine: load the model, size and create its caches, set up the fast paths
(fused kernels, CUDA graphs), the tensor-parallel ranks and the proposer's verify steps, warm up, and run
the steps the engine core schedules.

Rank 0 of a tensor-parallel engine starts one Worker per other rank (engine/parallel/runtime.py); each
builds its shard of the model and a KV cache of its own KV heads with rank 0's block count, then runs
every step rank 0 sends it.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from onecat.engine.args import EngineArgs
from onecat.engine.attention.selector import AttentionDispatcher
from onecat.engine.cache.kv import allocate_kv_caches, bytes_per_block
from onecat.engine.config import (cpu_kv_cache_budget_gb, kv_cache_storage_dtype, parse_dtype, parse_kv_cache_dtype,
                                  resolve_device)
from onecat.engine.core.scheduler_output import ScheduledSeq
from onecat.engine.core.step_result import StepResult
from onecat.engine.errors import ConfigError
from onecat.engine.layers.linear import pack_weights
from onecat.engine.layers.rotary import RotaryEmbedding
from onecat.engine.loader import open_checkpoint
from onecat.engine.loader.dummy import fill_random_weights
from onecat.engine.model_source import resolve_model_source
from onecat.engine.models.registry import model_class
from onecat.engine.models.support import effective_settings, num_state_snapshots, unsupported_settings
from onecat.engine.quant import WeightPacker, check_quantization
from onecat.engine.quant.hf_packer import W4A16_NAMES, W4A16Packer
from onecat.engine.sampling_params import SamplingParams
from onecat.engine.support_matrix import Combination, refuse
from onecat.engine.support_matrix.axes import RANDOM_LOAD_FORMATS
from onecat.engine.worker.fused_kernels import enable_fused_kernels
from onecat.engine.worker.model_runner import ModelRunner


def check_model_fits(model: torch.nn.Module, free: int, total: int, device, quantization: str | None) -> None:
    """Refuse, before allocating, a model whose parameters (still on meta) outgrow the device's free memory: the
    model is materialized in the engine's dtype before any packing, so a packed or quantized-at-load model needs
    its dense bytes at load too. A clear error instead of an out-of-memory traceback halfway through the load."""
    need = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    if need <= free:
        return
    gib = 2 ** 30
    packed = (f" (with quantization={quantization!r} the weights are packed only after they are loaded in "
              "the engine's dtype)") if quantization else ""
    raise ConfigError(f"the model needs {need / gib:.1f} GiB of {device} memory to load{packed}, but only "
                      f"{free / gib:.1f} of {total / gib:.1f} GiB are free; spread it over more GPUs "
                      "(tensor_parallel_size), load a smaller model, or free the GPU's memory")


class Worker:
    """Built from validated settings (`EngineArgs.unsupported()` already asked); the settings it runs,
    after what the model allows, are `cfg`."""

    def __init__(self, args: EngineArgs):
        self.cfg = args
        self.source = resolve_model_source(args.model, args.revision,
                                           weights_required=args.load_format not in RANDOM_LOAD_FORMATS)
        self.device = resolve_device(args.device)
        self.tp = None  # tensor parallel: this process's rank (engine/parallel)
        if args.tensor_parallel_size > 1:
            from onecat.engine.parallel.tensor_parallel import TensorParallel

            self.tp = TensorParallel(args.tensor_parallel_size, self.device,
                                     peer_collectives=not args.disable_custom_all_reduce)
            self.device = self.tp.device
        self.cpu_threads = None  # CPU, one rank: how many intra-op threads, and why (engine/cpu_threads.py)
        refuse(Combination.from_settings(args, device=self.device.type), "device")  # e.g. cpu_threads off the CPU
        if self.device.type == "cpu" and self.tp is None:
            from onecat.engine.cpu_threads import choose_cpu_threads

            self.cpu_threads = choose_cpu_threads(args.cpu_threads)
        check_quantization(args.quantization, self.source.format, self.device)
        self.w4a16 = W4A16Packer(args.quantization) if args.quantization in W4A16_NAMES else None
        ckpt = open_checkpoint(self.source, keep_quantized=args.quantization == "gguf",
                               on_quantized=self.w4a16.keep if self.w4a16 else None)
        self.model_config, self.tokenizer = ckpt.config, ckpt.tokenizer
        self.dtype = parse_dtype(args.dtype, self.device, self.model_config.torch_dtype)
        unsupported = unsupported_settings(args, self.model_config, self.device)
        if unsupported:
            raise ConfigError("; ".join(unsupported))
        self.cfg = effective_settings(args, self.model_config)
        # for info(): what GGUF packing did, or the quantized HF format that was read dequantized
        self.packing: dict | None = None if ckpt.stored_as is None else {
            "checkpoint": ckpt.stored_as, "dequantized_to": str(self.dtype).replace("torch.", "")}
        limit = self.model_config.max_position_embeddings
        self.max_model_len = self.cfg.max_model_len or limit
        if self.max_model_len > limit and not self.model_config.rope_scaling:
            raise ConfigError(f"max_model_len={self.max_model_len} exceeds the model's {limit} positions")
        self.model = self._build_model(ckpt)
        self.states = getattr(self.model, "states", None)  # a hybrid model's recurrent-state cache
        self.fused_kernels = enable_fused_kernels(self.model, self.device, self.dtype, self.cfg.fused_kernels)
        self._create_kv_caches()
        self.runner = ModelRunner(self.model, self.kv_caches, self.attention, self.cfg.block_size, self.device)
        self.setup_cuda_graphs(self.cfg.cuda_graph == "full")
        if self.tp is not None:
            self.runner.collectives = self.tp.collectives
            if not self.tp.is_worker:  # rank 0 starts the other ranks: each a Worker running the steps it sends
                self.runner.peers = self.tp.start_workers(type(self), args, self.num_kv_blocks)

    # ---- the model ----------------------------------------------------------------------------
    def _build_model(self, ckpt) -> torch.nn.Module:
        cls = model_class(self.model_config.architecture)
        with torch.device("meta"):
            model = cls(self.model_config, self.max_model_len)
        loader = None
        if self.tp is not None:  # sharded on meta: a rank allocates and loads only its share
            spec = self.cfg.speculative_config
            loader = self.tp.shard(model, keep_full_vocab=spec is not None and spec.method == "dflash")
            if self.w4a16 is not None:  # packed linears: this rank keeps its share of each
                self.w4a16.tensor_parallel(loader)
        model = model.to(self.dtype)  # on meta: storage comes once, in the engine's dtype (no float32 copy first)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            check_model_fits(model, free, total, self.device, self.cfg.quantization)
        model = model.to_empty(device=self.device)
        for m in model.modules():
            if isinstance(m, RotaryEmbedding):
                m.build_tables(self.device)
        if self.model_config.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        if self.cfg.quantization == "gguf":
            packer = WeightPacker(self.cfg.cpu_prompt_matmul)
            model.load_weights(packer.intercept(ckpt.weights))
            self.packing = packer.apply(model)
        elif self.cfg.load_format in RANDOM_LOAD_FORMATS:
            fill_random_weights(model, self.cfg.seed, peaked=self.cfg.load_format == "dummy_peaked")
        else:
            model.load_weights(loader.weights(ckpt.weights) if loader is not None else ckpt.weights)
        if loader is not None:
            self.tp.full_vocab = loader.full_vocab_layers(self.model_config.tie_word_embeddings)
        if self.w4a16 is not None:  # 4-bit linears kept packed (CUDA GEMV kernels; CPU: the int4 layer)
            self.packing = self.w4a16.apply(model)
        if self.device.type == "cpu" and torch.backends.mkldnn.is_available():
            pack_weights(model)
        if hasattr(model, "allocate_recurrent_state"):  # hybrid: one state slot per request that may run at once
            model.allocate_recurrent_state(self.cfg.max_num_seqs, self.dtype, self.device,
                                           num_state_snapshots(self.cfg))
        return model.eval()

    def vocab_layers(self) -> tuple[torch.nn.Module, torch.nn.Module]:
        """The target's whole embedding and LM head, for a drafter that calls them outside a step (under
        tensor parallel the model's own are sharded, and rank 0 keeps copies)."""
        if self.tp is not None and self.tp.full_vocab is not None:
            return self.tp.full_vocab
        return self.model.embed_tokens, self.model.lm_head

    def greedy_tokens(self, logits: torch.Tensor) -> torch.Tensor:
        return self.model.greedy_tokens(logits)

    # ---- caches -------------------------------------------------------------------------------
    def _create_kv_caches(self) -> None:
        """Size the paged KV cache (this rank's KV heads under tensor parallel) and allocate it."""
        fp8 = parse_kv_cache_dtype(self.cfg.kv_cache_dtype)
        kv_config = self.tp.kv_config(self.model_config) if self.tp else self.model_config
        self.num_kv_blocks = self._num_kv_blocks(fp8 is not None, kv_config)
        torch.manual_seed(self.cfg.seed)
        self.attention = AttentionDispatcher(self.cfg.attention_backend, self.device,
                                             prompt_tiles=self.cfg.cpu_prompt_matmul == "bf16")
        self.kv_caches = allocate_kv_caches(len(kv_config.kv_layer_ids), self.num_kv_blocks, self.cfg.block_size,
                                            kv_config.num_key_value_heads, kv_config.head_dim,
                                            kv_cache_storage_dtype(self.cfg.kv_cache_dtype, self.dtype), fp8,
                                            self.device)

    def _num_kv_blocks(self, fp8: bool, mc) -> int:
        c = self.cfg
        per_block = bytes_per_block(len(mc.kv_layer_ids), c.block_size, mc.num_key_value_heads, mc.head_dim,
                                    kv_cache_storage_dtype(c.kv_cache_dtype, self.dtype), fp8)
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

    # ---- fast paths ---------------------------------------------------------------------------
    def setup_cuda_graphs(self, enabled: bool) -> None:
        """Full-step CUDA graphs for decode (and verify) steps, fresh (captured on first use), when `enabled`
        on CUDA; otherwise the graphs stay as they are."""
        self.runner.setup_cuda_graphs(enabled, self.max_model_len, self.cfg.max_num_seqs)

    @property
    def graphs(self):
        """The decode graphs (cuda_graph.DecodeGraphs), or None when steps run eagerly."""
        return self.runner.graphs

    def cuda_graph_report(self) -> dict:
        return self.runner.cuda_graph_report()

    @contextmanager
    def graphs_replaced(self, enabled: bool) -> Iterator[None]:
        """Steps in the block run on fresh graphs (`enabled`) or eagerly; then the graphs from before, with
        what they captured, come back."""
        saved, self.runner.graphs = self.runner.graphs, None
        try:
            self.setup_cuda_graphs(enabled)
            yield
        finally:
            self.runner.graphs = saved

    def setup_verify(self, num_speculative_tokens: int, exact_batch1: bool = False, narrow: bool = False) -> None:
        """Speculative decoding verifies 1 + k tokens a step: their graphs (`narrow`: also narrower ones, for
        requests that draft fewer), and with `exact_batch1` the batch-1 GEMV for them when the Triton fused
        kernels are on (ModelRunner.setup_verify says why)."""
        fused = self.fused_kernels
        self.runner.setup_verify(1 + num_speculative_tokens,
                                 exact_batch1 and fused["used"] and fused["kind"] == "triton", narrow)

    def warm_up(self, generate: Callable[[list[list[int]], list[SamplingParams]], object],
                reset_counters: Callable[[], None]) -> dict:
        """Compile kernels and capture graphs before the first request (warmup.py); requests go through
        `generate`, the engine's path."""
        from onecat.engine.worker.warmup import warm_up

        return warm_up(self.runner, self.model_config.vocab_size, self.max_model_len,
                       self.cfg.max_num_batched_tokens, generate, reset_counters, dtype=self.dtype)

    # ---- steps --------------------------------------------------------------------------------
    def execute(self, scheduled: list[ScheduledSeq]) -> StepResult:
        return self.runner.execute(scheduled)

    @property
    def has_peer_ranks(self) -> bool:
        """Rank 0 of a tensor-parallel engine: every step is sent to the other ranks first."""
        return self.runner.peers is not None

    def run_remote(self, kind: str, payload) -> None:
        """A tensor-parallel worker rank: run what rank 0 sent (engine/parallel/runtime.py)."""
        if kind == "states":  # rank 0's recurrent-state snapshot copies, before its next step
            self.states.replay(payload)
            return
        with torch.inference_mode():
            self.runner.run_remote(kind, payload)

    def reset_counters(self) -> None:
        self.attention.calls.clear()

    def close(self) -> None:
        """Stop the other tensor-parallel ranks and let go of the model and its caches. Safe to call twice."""
        if self.tp is not None and not self.tp.is_worker:
            self.tp.close()
        self.model = self.states = self.runner = self.kv_caches = self.attention = None
