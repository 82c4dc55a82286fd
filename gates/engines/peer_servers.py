"""Real peer servers the harness starts itself with the contract's settings: `vllm_serve` (vLLM's
OpenAI server, CPU build on CPU machines) and `llama_cpp_serve` (llama-cpp-python's server, GGUF).

Each peer runs from its own venv (scripts/setup_peers.sh puts them in .onecat/peers/<peer>/), or
from `engine.options.python`. vLLM loads HF directories, so a GGUF source (the embedded model) is
exported once to safetensors with the weights onecat itself reads (gates/engines/hf_export.py).
llama.cpp reads the GGUF directly (its own quantized kernels: same weights, different numerics).

    engine: {backend: vllm_serve, max_num_seqs: 16, options: {kv_cache_space_gib: 2}}
    engine: {backend: llama_cpp_serve, options: {n_threads: 2}}
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from onecat.gates.contract import ArmSettings
from onecat.gates.engines.base import EngineUnavailableError
from onecat.gates.engines.openai_engine import OpenAIEndpointEngine
from onecat.gates.registry import register_engine

PEERS_DIR = Path(os.environ.get("ONECAT_PEERS_DIR", ".onecat/peers"))


def _peer_python(arm: ArmSettings, peer: str, module: str) -> tuple[str | None, str | None]:
    """(python, problem): the interpreter that can import `module` for this peer."""
    python = arm.engine.options.get("python") or str(PEERS_DIR / peer / "bin" / "python")
    if not Path(python).is_file():
        return None, (f"{peer} peer not installed: no {python}; run `scripts/setup_peers.sh {peer}` or set "
                      f"engine.options.python to an interpreter that has {module}")
    return python, None


class _ManagedPeer(OpenAIEndpointEngine):
    peer = "?"
    module = "?"
    log_name = "server"

    @classmethod
    def check(cls, arm: ArmSettings) -> list[str]:
        from onecat.engine.model_source import resolve_model_source

        problems = []
        _, problem = _peer_python(arm, cls.peer, cls.module)
        if problem:
            problems.append(problem)
        try:
            resolve_model_source(arm.model.source, arm.model.revision)
        except Exception as exc:  # noqa: BLE001 - the resolver's message says what and where
            problems.append(f"target model: {exc}")
        if arm.engine.tensor_parallel_size != 1:
            problems.append(f"{cls.registry_name} on this machine runs with tensor_parallel_size: 1")
        return problems

    @classmethod
    def argv(cls, arm: ArmSettings, python: str, port: int, seed: int) -> tuple[list[str], dict]:
        raise NotImplementedError

    @classmethod
    def open(cls, arm: ArmSettings, seed: int = 0):
        from onecat.gates.engines.server_process import free_port

        python, problem = _peer_python(arm, cls.peer, cls.module)
        if problem:
            raise EngineUnavailableError(problem)
        port = int(arm.engine.options.get("port") or free_port())
        argv, env = cls.argv(arm, python, port, seed)
        return cls.start_managed(arm, seed, argv, port, name=cls.log_name, default_timeout_s=900, env=env,
                                 ready_path=cls.ready_path)

    ready_path = "/health"

    def info(self) -> dict:
        info = super().info()
        proc = getattr(self, "process", None)
        if proc is not None:
            info.update(server_log=str(proc.log_path), server_argv=" ".join(proc.argv),
                        server_startup_s=proc.startup_s, peer=self.peer)
        return info

    def close(self) -> None:
        proc = getattr(self, "process", None)
        if proc is not None:
            proc.stop()


@register_engine("vllm_serve")
class ManagedVllmServer(_ManagedPeer):
    peer, module, log_name = "vllm", "vllm", "vllm_serve"
    reads_chat_template_kwargs = True

    @classmethod
    def argv(cls, arm: ArmSettings, python: str, port: int, seed: int) -> tuple[list[str], dict]:
        from onecat.gates.engines.hf_export import export_hf_dir

        e = arm.engine
        model_dir = export_hf_dir(arm.model.source)
        name = e.options.get("served_model_name") or arm.model.source
        argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                "--served-model-name", name, "--host", "127.0.0.1", "--port", str(port), "--seed", str(seed),
                "--max-num-seqs", str(e.max_num_seqs), "--max-num-batched-tokens", str(e.max_num_batched_tokens),
                "--dtype", "float32" if arm.model.dtype == "auto" else arm.model.dtype,
                "--enable-prefix-caching" if e.enable_prefix_caching else "--no-enable-prefix-caching",
                "--uvicorn-log-level", "warning"]
        if e.max_model_len:
            argv += ["--max-model-len", str(e.max_model_len)]
        if e.kv_cache_dtype != "auto":
            argv += ["--kv-cache-dtype", e.kv_cache_dtype]
        if arm.speculative is not None:
            argv += ["--speculative-config", json.dumps(arm.speculative.model_dump(exclude_none=True))]
        argv += [str(x) for x in e.options.get("extra_args", [])]
        env = {"VLLM_CPU_KVCACHE_SPACE": str(e.options.get("kv_cache_space_gib", 2)),
               "VLLM_TARGET_DEVICE": "cpu" if e.device in ("cpu", "auto") else "cuda",
               "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}
        return argv, env


@register_engine("llama_cpp_serve")
class ManagedLlamaCppServer(_ManagedPeer):
    peer, module, log_name = "llamacpp", "llama_cpp", "llama_cpp_serve"
    ready_path = "/v1/models"

    @classmethod
    def argv(cls, arm: ArmSettings, python: str, port: int, seed: int) -> tuple[list[str], dict]:
        from onecat.engine.model_source import resolve_model_source

        e = arm.engine
        resolved = resolve_model_source(arm.model.source, arm.model.revision)
        if resolved.format != "gguf":
            raise EngineUnavailableError(f"llama_cpp_serve needs a GGUF model; {arm.model.source} is "
                                         f"{resolved.format}")
        name = e.options.get("served_model_name") or arm.model.source
        argv = [python, "-m", "llama_cpp.server", "--model", str(resolved.path), "--model_alias", name,
                "--host", "127.0.0.1", "--port", str(port), "--n_ctx", str(e.max_model_len or 2048),
                "--seed", str(seed), "--n_threads", str(e.options.get("n_threads", os.cpu_count() or 1)),
                "--n_batch", str(min(e.max_num_batched_tokens, 2048)),
                "--interrupt_requests", "False"]  # queue concurrent requests instead of cutting the running one
        argv += [str(x) for x in e.options.get("extra_args", [])]
        return argv, {}

    def __init__(self, arm: ArmSettings, base_url: str, seed: int = 0):
        super().__init__(arm, base_url, seed)
        self.return_token_ids = False  # llama-cpp-python has no token-id logprobs; text is re-tokenized

    def adjust_body(self, body: dict) -> dict:
        body = super().adjust_body(body)
        eos = list(getattr(self.tokenizer, "eos_token_ids", []) or [])
        if body.pop("ignore_eos", False) and eos:  # no such field in llama.cpp: bias EOS away instead
            body["logit_bias"] = {**body.get("logit_bias", {}), **{str(t): -100.0 for t in eos}}
        return body
