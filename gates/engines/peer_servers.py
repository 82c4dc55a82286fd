"""Real peer servers the harness starts itself with the arm's settings (gates/engines/openai_engine.py's
ManagedServerEngine: start, connect, stop):

    vllm_serve       vLLM's OpenAI server (its CPU build on CPU machines). It loads HF directories, so a GGUF
                     source (the embedded model) is exported once to float32 safetensors (hf_export.py).
    llama_cpp_serve  llama-cpp-python's server: the GGUF as stored, llama.cpp's kernels, one request at a time.
    llama_server     llama.cpp's own `llama-server`: the GGUF as stored, `max_num_seqs` parallel slots decoded
                     together (continuous batching).

Every setting of the arm reaches the server, as a flag, an environment variable or a field of each request,
or check() refuses it, naming the setting, the backend and the value it takes: a comparison row never claims
a setting its server did not run. `device: auto` means the CPU for the peers.

The program that runs a peer: `engine.options.python` for the Python servers (default
.onecat/peers/<peer>/bin/python, from scripts/setup_peers.sh), `engine.options.executable` for llama-server
(default .onecat/peers/llama-server/bin/llama-server, else `llama-server` on PATH).

    engine: {backend: vllm_serve, max_num_seqs: 16, options: {kv_cache_space_gib: 2}}
    engine: {backend: llama_server, max_model_len: 2048, max_num_seqs: 16, options: {n_threads: 2}}
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from onecat.gates.contract import ArmSettings
from onecat.gates.engines.base import EngineUnavailableError
from onecat.gates.engines.openai_engine import ManagedServerEngine
from onecat.gates.registry import register_engine

PEERS_DIR = Path(os.environ.get("ONECAT_PEERS_DIR", ".onecat/peers"))
BUILD_INFO = "build-info.txt"  # key=value lines scripts/setup_peers.sh writes next to a peer it built


def _setting(arm: ArmSettings, path: str) -> Any:
    """The value at a contract path such as `model.dtype`, `engine.max_num_seqs` or `speculative`."""
    value: Any = arm
    for part in path.split("."):
        value = getattr(value, part)
    return value


def _refused(backend: str, path: str, value: Any, why: str, takes: Any) -> str:
    fix = f"remove {path}" if takes is None else f"set {path}: {json.dumps(takes)}"
    shown = value.model_dump(exclude_none=True) if hasattr(value, "model_dump") else value
    return f"{backend} cannot take {path} {json.dumps(shown, default=str)}: {why}; {fix}"


def _on_cuda(arm: ArmSettings) -> bool:
    return arm.engine.device.startswith("cuda")


def _device_env(arm: ArmSettings) -> dict[str, str]:
    """The GPUs the server may see: none on the CPU, GPU N for cuda:N."""
    device = arm.engine.device
    if not _on_cuda(arm):
        return {"CUDA_VISIBLE_DEVICES": ""}
    return {"CUDA_VISIBLE_DEVICES": device.split(":", 1)[1]} if ":" in device else {}


class _ManagedPeer(ManagedServerEngine):
    peer = "?"  # its folder under PEERS_DIR
    startup_timeout_s = 900.0
    # settings this peer runs one way only: contract path -> (the value it takes, why)
    FIXED: dict[str, tuple[Any, str]] = {}

    @classmethod
    def refusals(cls, arm: ArmSettings) -> list[str]:
        from onecat.engine.model_source import EMBEDDED_PREFIX

        problems = super().refusals(arm)
        for path, (takes, why) in cls.FIXED.items():
            value = _setting(arm, path)
            if value != takes:
                problems.append(_refused(cls.registry_name, path, value, why, takes))
        source = arm.model.source
        local = source.startswith(EMBEDDED_PREFIX) or Path(source).expanduser().exists()
        if arm.model.revision is not None and local:
            problems.append(_refused(cls.registry_name, "model.revision", arm.model.revision,
                                     f"a revision selects a hub snapshot, and {source} is a local model", None))
        return problems

    @classmethod
    def launcher(cls, arm: ArmSettings) -> tuple[str | None, str | None]:
        """(program, problem): what runs this peer here."""
        raise NotImplementedError

    @classmethod
    def server_args(cls, arm: ArmSettings, port: int, seed: int) -> tuple[list[str], dict[str, str]]:
        """(arguments after the program, extra environment) for `arm`."""
        raise NotImplementedError

    @classmethod
    def check(cls, arm: ArmSettings) -> list[str]:
        from onecat.engine.model_source import resolve_model_source

        problems = cls.refusals(arm)
        _, problem = cls.launcher(arm)
        if problem:
            problems.append(problem)
        try:
            resolve_model_source(arm.model.source, arm.model.revision)
        except Exception as exc:  # noqa: BLE001 - the resolver's message says what and where
            problems.append(f"target model: {exc}")
        return problems

    @classmethod
    def command(cls, arm: ArmSettings, port: int, seed: int) -> tuple[list[str], dict[str, str]]:
        program, problem = cls.launcher(arm)
        if problem:
            raise EngineUnavailableError(problem)
        args, env = cls.server_args(arm, port, seed)
        return [program, *args, *(str(x) for x in arm.engine.options.get("extra_args", []))], env

    @classmethod
    def served_name(cls, arm: ArmSettings) -> str:
        return arm.engine.options.get("served_model_name") or arm.model.source

    def info(self) -> dict:
        info = {**super().info(), "peer": self.peer}
        build = PEERS_DIR / self.peer / BUILD_INFO
        if build.is_file():  # how scripts/setup_peers.sh built it (compiler, flags, AMX on or off)
            info["peer_build"] = dict(line.split("=", 1) for line in build.read_text().splitlines() if "=" in line)
        return info


class _PythonPeer(_ManagedPeer):
    """A peer that runs as `python -m MODULE` from its own venv."""

    module = "?"
    OPTIONS = ("python", "extra_args")

    @classmethod
    def launcher(cls, arm: ArmSettings) -> tuple[str | None, str | None]:
        python = arm.engine.options.get("python") or str(PEERS_DIR / cls.peer / "bin" / "python")
        if not Path(python).is_file():
            return None, (f"{cls.registry_name}: peer not installed: no {python}; run `scripts/setup_peers.sh "
                          f"{cls.peer}` or set engine.options.python to an interpreter that has {cls.module}")
        return python, None

    @classmethod
    def command(cls, arm: ArmSettings, port: int, seed: int) -> tuple[list[str], dict[str, str]]:
        argv, env = super().command(arm, port, seed)
        return [argv[0], "-m", cls.module, *argv[1:]], env


@register_engine("vllm_serve")
class ManagedVllmServer(_PythonPeer):
    peer, module, log_name = "vllm", "vllm.entrypoints.openai.api_server", "vllm_serve"
    reads_chat_template_kwargs = True
    OPTIONS = _PythonPeer.OPTIONS + ("kv_cache_space_gib",)
    FIXED = {
        "model.quantization": (None, "vllm_serve loads the HF export of the model, dequantized to float32; packed "
                                     "GGUF weights run on llama_cpp_serve or llama_server"),
        "engine.attention_backend": ("auto", "it names one of onecat's attention kernels; vLLM picks its own"),
    }

    @classmethod
    def refusals(cls, arm: ArmSettings) -> list[str]:
        problems = super().refusals(arm)
        e = arm.engine
        if not _on_cuda(arm) and e.cuda_graph != "off":
            problems.append(_refused(cls.registry_name, "engine.cuda_graph", e.cuda_graph,
                                     f"CUDA graphs need a CUDA device and engine.device is {e.device}", "off"))
        if _on_cuda(arm) and "kv_cache_space_gib" in e.options:
            problems.append("vllm_serve reads engine.options.kv_cache_space_gib only on the CPU "
                            "(VLLM_CPU_KVCACHE_SPACE); remove it for a CUDA device")
        spec = arm.speculative
        if spec is not None:
            if spec.method == "dflash":
                problems.append(_refused(cls.registry_name, "speculative.method", "dflash",
                                         "vLLM has no DFlash drafter", "draft_model"))
            for name in ("adaptive", "max_speculative_tokens"):
                if getattr(spec, name) is not None:
                    problems.append(_refused(cls.registry_name, f"speculative.{name}", getattr(spec, name),
                                             "adaptive n-gram drafting is onecat's; vLLM drafts "
                                             "num_speculative_tokens every step", None))
            if spec.dtype != "auto":
                problems.append(_refused(cls.registry_name, "speculative.dtype", spec.dtype,
                                         "vLLM runs the drafter in the target's dtype", "auto"))
        return problems

    def isa_used(self, log_text: str) -> dict | None:
        from onecat.gates.engines.isa_report import torch_isa

        return torch_isa(self.process.argv[0]) if getattr(self, "process", None) else None

    @classmethod
    def _hf_dir(cls, source: str, revision: str | None) -> str:
        from onecat.engine.model_source import resolve_model_source
        from onecat.gates.engines.hf_export import export_hf_dir

        return str(export_hf_dir(str(resolve_model_source(source, revision).path)))

    @classmethod
    def _speculative_config(cls, arm: ArmSettings) -> dict:
        spec = arm.speculative
        config: dict[str, Any] = {"method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens}
        if spec.model:
            config["model"] = cls._hf_dir(spec.model, spec.revision)
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            if getattr(spec, name) is not None:
                config[name] = getattr(spec, name)
        return config

    @classmethod
    def server_args(cls, arm: ArmSettings, port: int, seed: int) -> tuple[list[str], dict[str, str]]:
        e, cuda = arm.engine, _on_cuda(arm)
        dtype = "float32" if arm.model.dtype == "auto" and not cuda else arm.model.dtype  # onecat's auto on CPU
        args = ["--model", cls._hf_dir(arm.model.source, arm.model.revision),
                "--served-model-name", cls.served_name(arm), "--host", "127.0.0.1", "--port", str(port),
                "--seed", str(seed), "--dtype", dtype, "--max-num-seqs", str(e.max_num_seqs),
                "--max-num-batched-tokens", str(e.max_num_batched_tokens), "--kv-cache-dtype", e.kv_cache_dtype,
                "--tensor-parallel-size", str(e.tensor_parallel_size),
                "--pipeline-parallel-size", str(e.pipeline_parallel_size),
                "--enable-prefix-caching" if e.enable_prefix_caching else "--no-enable-prefix-caching",
                "--generation-config", "vllm",  # the request's sampling settings, not the model's generation_config
                "--uvicorn-log-level", "warning"]
        if e.max_model_len:
            args += ["--max-model-len", str(e.max_model_len)]
        if e.mamba_cache_mode != "none":
            args += ["--mamba-cache-mode", e.mamba_cache_mode]
        if cuda:
            args += (["--enforce-eager"] if e.cuda_graph == "off" else
                     ["--compilation-config", json.dumps({"cudagraph_mode": e.cuda_graph.upper()})])
        if arm.speculative is not None:
            args += ["--speculative-config", json.dumps(cls._speculative_config(arm))]
        env = {**_device_env(arm), "VLLM_TARGET_DEVICE": "cuda" if cuda else "cpu", "VLLM_NO_USAGE_STATS": "1",
               "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}
        if not cuda:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(e.options.get("kv_cache_space_gib", 2))
        return args, env


# what llama.cpp runs one way only, for both of its servers
_LLAMA_CPP_FIXED = {
    "model.dtype": ("auto", "llama.cpp computes in the GGUF's own tensor types"),
    "model.quantization": ("gguf", "llama.cpp runs the GGUF's tensors packed, with its own kernels; say so"),
    "engine.kv_cache_dtype": ("auto", "llama.cpp's KV cache types are f16/q8_0/q4_0, not fp8"),
    "engine.tensor_parallel_size": (1, "the harness starts llama.cpp on one device"),
    "engine.pipeline_parallel_size": (1, "the harness starts llama.cpp on one device"),
    "engine.attention_backend": ("auto", "it names one of onecat's attention kernels; llama.cpp has its own"),
    "engine.cuda_graph": ("off", "llama.cpp decides on CUDA graphs itself"),
    "engine.mamba_cache_mode": ("none", "the harness passes no Mamba state caching to llama.cpp"),
    "speculative": (None, "the harness starts llama.cpp without a drafter"),
}


class _LlamaCppPeer(_ManagedPeer):
    """llama.cpp reads the GGUF directly; its own sampling defaults (top_k 40, min_p 0.05, a repeat penalty) are
    turned off in every request unless the request sets them, so both servers sample as the contract says."""

    FIXED = _LLAMA_CPP_FIXED

    @classmethod
    def check(cls, arm: ArmSettings) -> list[str]:
        problems = super().check(arm)
        if not any(p.startswith("target model:") for p in problems):
            try:
                cls.gguf_path(arm)
            except EngineUnavailableError as exc:
                problems.append(str(exc))
        return problems

    @classmethod
    def gguf_path(cls, arm: ArmSettings) -> str:
        from onecat.engine.model_source import resolve_model_source

        resolved = resolve_model_source(arm.model.source, arm.model.revision)
        if resolved.format != "gguf":
            raise EngineUnavailableError(f"{cls.registry_name} needs a GGUF model; {arm.model.source} is "
                                         f"{resolved.format}")
        return str(resolved.path)

    @classmethod
    def threads(cls, arm: ArmSettings) -> str:
        return str(arm.engine.options.get("n_threads", os.cpu_count() or 1))

    def __init__(self, arm: ArmSettings, base_url: str, seed: int = 0):
        super().__init__(arm, base_url, seed)
        self.return_token_ids = False  # no token-id logprobs: the text is re-tokenized

    @classmethod
    def request_defaults(cls, arm: ArmSettings) -> dict:
        return {"top_k": 0, "min_p": 0.0, "repeat_penalty": 1.0}

    def isa_used(self, log_text: str) -> dict | None:
        from onecat.gates.engines.isa_report import llama_cpp_isa

        return llama_cpp_isa(log_text)


@register_engine("llama_cpp_serve")
class ManagedLlamaCppServer(_LlamaCppPeer, _PythonPeer):
    peer, module, log_name = "llamacpp", "llama_cpp.server", "llama_cpp_serve"
    ready_path = "/v1/models"
    OPTIONS = _PythonPeer.OPTIONS + ("n_threads",)
    FIXED = {**_LLAMA_CPP_FIXED,
             "engine.max_num_seqs": (1, "llama-cpp-python's server decodes one request at a time (for parallel "
                                        "slots use backend llama_server)"),
             "engine.enable_prefix_caching": (True, "llama-cpp-python always reuses the prompt prefix it "
                                                    "evaluated last"),
             "reasoning.enabled": (False, "llama-cpp-python's server takes no chat-template variables")}

    @classmethod
    def server_args(cls, arm: ArmSettings, port: int, seed: int) -> tuple[list[str], dict[str, str]]:
        e = arm.engine
        args = ["--model", cls.gguf_path(arm), "--model_alias", cls.served_name(arm), "--host", "127.0.0.1",
                "--port", str(port), "--seed", str(seed),
                "--n_ctx", str(e.max_model_len or 0),  # 0: the model's context
                "--n_batch", str(e.max_num_batched_tokens), "--n_threads", cls.threads(arm),
                "--n_gpu_layers", "-1" if _on_cuda(arm) else "0",
                "--cache", "True",  # prefix states kept across requests (enable_prefix_caching)
                "--interrupt_requests", "False"]  # queue concurrent requests instead of cutting the running one
        return args, _device_env(arm)

    def adjust_body(self, body: dict) -> dict:
        body = super().adjust_body(body)
        eos = list(getattr(self.tokenizer, "eos_token_ids", []) or [])
        if body.pop("ignore_eos", False) and eos:  # no such field here: bias EOS away instead
            body["logit_bias"] = {**body.get("logit_bias", {}), **{str(t): -100.0 for t in eos}}
        return body


@register_engine("llama_server")
class ManagedLlamaServer(_LlamaCppPeer):
    """llama.cpp's `llama-server`: `max_num_seqs` slots with continuous batching, each slot `max_model_len`
    tokens of context (--ctx-size is their total). Prefix caching is each request's `cache_prompt`."""

    peer, log_name = "llama-server", "llama_server"
    reads_chat_template_kwargs = True  # --jinja: the GGUF's chat template, with chat_template_kwargs
    OPTIONS = ("executable", "extra_args", "n_threads")

    @classmethod
    def refusals(cls, arm: ArmSettings) -> list[str]:
        problems = super().refusals(arm)
        if arm.engine.max_model_len is None:
            problems.append("llama_server needs engine.max_model_len: llama-server splits its context over "
                            "max_num_seqs slots, so say how long one request may be")
        return problems

    @classmethod
    def launcher(cls, arm: ArmSettings) -> tuple[str | None, str | None]:
        given = arm.engine.options.get("executable")
        installed = PEERS_DIR / cls.peer / "bin" / "llama-server"
        program = given or (str(installed) if installed.is_file() else shutil.which("llama-server"))
        if not program or not Path(program).is_file():
            return None, (f"llama_server: llama.cpp's llama-server not found ({given or f'{installed}, PATH'}); "
                          "install it there or set engine.options.executable to the llama-server binary")
        return program, None

    @classmethod
    def server_args(cls, arm: ArmSettings, port: int, seed: int) -> tuple[list[str], dict[str, str]]:
        e = arm.engine
        args = ["--model", cls.gguf_path(arm), "--alias", cls.served_name(arm), "--host", "127.0.0.1",
                "--port", str(port), "--seed", str(seed), "--parallel", str(e.max_num_seqs), "--cont-batching",
                "--ctx-size", str((e.max_model_len or 0) * e.max_num_seqs),
                "--batch-size", str(e.max_num_batched_tokens), "--threads", cls.threads(arm),
                "--n-gpu-layers", "999" if _on_cuda(arm) else "0", "--jinja",
                "--log-verbosity", "4"]  # its system_info line (the ISA it runs) is printed from level 4 on
        return args, _device_env(arm)

    @classmethod
    def request_defaults(cls, arm: ArmSettings) -> dict:
        return {**super().request_defaults(arm), "cache_prompt": arm.engine.enable_prefix_caching}
