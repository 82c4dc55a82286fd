"""OpenAI-compatible endpoints as harness engines: `openai` (a URL you run) and `onecat_serve`
(an `onecat serve` process the harness starts with the contract's settings and stops afterwards).
`ManagedServerEngine` is the start / connect / stop path of every server the harness starts itself
(`onecat_serve` here, the peers in peer_servers.py).

Contract examples:

    engine: {backend: openai, base_url: "http://127.0.0.1:8000", options: {api_key_env: MY_KEY}}
    engine: {backend: onecat_serve, max_num_seqs: 64, options: {serve_flags: {max_queue_len: 512}}}

`model.source` is the model name sent to the server (options.served_model_name overrides it). A
request's sampling fields are its SamplingParams as engine/server/sampling_body.py writes them (the
module the onecat server reads them back with).
Requests are streamed, so every RequestOutput carries client-side TTFT / decode / e2e times. Token
ids come back through vLLM's `return_tokens_as_token_ids` (onecat and vLLM servers honour it);
otherwise the text is tokenized with the model's local tokenizer or the server's /tokenize.
"""
from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import httpx

from onecat.engine.sampling_params import SamplingParams
from onecat.engine.server.sampling_body import body_fields
from onecat.gates.contract import ArmSettings
from onecat.gates.engines.base import EngineAdapter, EngineDiedError, EngineUnavailableError, PromptParams
from onecat.gates.engines.openai_client import parse_prometheus, stream_completion
from onecat.gates.registry import register_engine

DEFAULT_CONCURRENCY = 64


def _reachable(url: str, headers: dict) -> str | None:
    try:
        r = httpx.get(url.rstrip("/") + "/v1/models", headers=headers, timeout=5.0)
    except httpx.HTTPError as exc:
        return f"cannot reach {url}/v1/models ({type(exc).__name__}: {exc}); start the server or fix engine.base_url"
    if r.status_code != 200:
        return f"{url}/v1/models answered HTTP {r.status_code}: {r.text[:200]}"
    return None


class _RemoteTokenizer:
    """encode/decode through the server's /tokenize and /detokenize (vLLM and onecat have them)."""

    def __init__(self, url: str, headers: dict, model: str):
        self.url, self.headers, self.model = url, headers, model
        self.eos_token_ids: list[int] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        r = httpx.post(self.url + "/tokenize", json={"model": self.model, "prompt": text,
                                                     "add_special_tokens": add_special_tokens},
                       headers=self.headers, timeout=30)
        r.raise_for_status()
        return list(r.json()["tokens"])

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        r = httpx.post(self.url + "/detokenize", json={"model": self.model, "tokens": list(ids)},
                       headers=self.headers, timeout=30)
        r.raise_for_status()
        return r.json()["prompt"]


def _local_tokenizer(source: str):
    """(tokenizer, vocab_size) from a locally resolvable model, without loading its weights."""
    try:
        from onecat.engine.loader import open_checkpoint
        from onecat.engine.model_source import resolve_model_source

        ckpt = open_checkpoint(resolve_model_source(source))
        return ckpt.tokenizer, ckpt.config.vocab_size
    except Exception:  # noqa: BLE001 - a served name need not exist locally
        return None, None


@register_engine("openai")
class OpenAIEndpointEngine(EngineAdapter):
    reads_chat_template_kwargs = False  # servers known to read vLLM's `chat_template_kwargs` set this

    @classmethod
    def _url(cls, arm: ArmSettings) -> str | None:
        return arm.engine.base_url or arm.engine.options.get("base_url")

    @classmethod
    def _headers(cls, arm: ArmSettings) -> dict:
        opts = arm.engine.options
        key = opts.get("api_key") or (os.environ.get(opts["api_key_env"]) if opts.get("api_key_env") else None)
        return {"Authorization": f"Bearer {key}"} if key else {}

    @classmethod
    def check(cls, arm: ArmSettings) -> list[str]:
        url = cls._url(arm)
        if not url:
            return ["engine.base_url is required for backend openai (e.g. http://127.0.0.1:8000)"]
        problem = _reachable(url, cls._headers(arm))
        return [problem] if problem else []

    @classmethod
    def open(cls, arm: ArmSettings, seed: int = 0) -> "OpenAIEndpointEngine":
        return cls(arm, cls._url(arm), seed)

    def __init__(self, arm: ArmSettings, base_url: str, seed: int = 0):
        self.arm = arm
        self.base_url = base_url.rstrip("/")
        self.headers = self._headers(arm)
        self.concurrency = int(arm.engine.options.get("client_concurrency", DEFAULT_CONCURRENCY))
        self.model = arm.engine.options.get("served_model_name") or self._first_model() or arm.model.source
        local, vocab = _local_tokenizer(arm.model.source)
        self.tokenizer = local or _RemoteTokenizer(self.base_url, self.headers, self.model)
        self.vocab_size = vocab
        self.return_token_ids = True

    def adjust_body(self, body: dict) -> dict:
        """Last word on a request body: `engine.options.extra_body` merged in (peers override this)."""
        extra = self.arm.engine.options.get("extra_body") or {}
        return {**body, **extra} if extra else body

    def _first_model(self) -> str | None:
        try:
            data = httpx.get(self.base_url + "/v1/models", headers=self.headers, timeout=5).json()["data"]
            return data[0]["id"] if data else None
        except Exception:  # noqa: BLE001
            return None

    # ---- requests ---------------------------------------------------------------------------
    def _run_all(self, jobs: list[tuple[str, dict, bool]]) -> list:
        async def go():
            sem = asyncio.Semaphore(self.concurrency)
            limits = httpx.Limits(max_connections=self.concurrency + 4)
            async with httpx.AsyncClient(base_url=self.base_url, limits=limits, timeout=httpx.Timeout(3600.0),
                                         headers=self.headers) as client:
                async def one(path, body, chat):
                    async with sem:
                        return await stream_completion(client, path, self.adjust_body(body), chat=chat)
                return await asyncio.gather(*(one(*j) for j in jobs))
        return asyncio.run(go())

    def _to_output(self, rid: str, prompt: Any, prompt_ids: list[int], res: Any, params: SamplingParams):
        from onecat.engine.outputs import RequestOutput, RequestTimings

        ids = self._token_ids(res)
        ttft = res.ttft_s or 0.0
        timings = RequestTimings(queue_s=0.0, prefill_s=ttft, first_token_s=ttft,
                                 decode_s=max((res.e2e_s or 0.0) - ttft, 0.0), e2e_s=res.e2e_s or 0.0)
        err = None if res.ok else (res.error or f"HTTP {res.status}")
        return RequestOutput(request_id=rid, prompt=prompt if isinstance(prompt, str) else None,
                             prompt_token_ids=prompt_ids, token_ids=ids, text=res.text,
                             finish_reason=res.finish_reason if res.ok else "abort", error=err,
                             timings=timings, finished=True)

    def _token_ids(self, res: Any) -> list[int]:
        if res.token_ids:
            return res.token_ids
        if not res.text:
            return []
        try:
            return self.tokenizer.encode(res.text, add_special_tokens=False)
        except Exception:  # noqa: BLE001
            return []

    def generate(self, prompts: list, params: PromptParams) -> list:
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        jobs, prompt_ids = [], []
        for p, sp in zip(prompts, params_list):
            ids = list(p) if not isinstance(p, str) else self.tokenizer.encode(p)
            prompt_ids.append(ids)
            body = {"model": self.model, "prompt": ids if not isinstance(p, str) else p, **body_fields(sp)}
            if self.return_token_ids:
                body.update(logprobs=0, return_tokens_as_token_ids=True)
            jobs.append(("/v1/completions", body, False))
        results = self._run_all(jobs)
        return [self._to_output(str(i), p, ids, r, sp)
                for i, (p, ids, r, sp) in enumerate(zip(prompts, prompt_ids, results, params_list))]

    def _template_kwargs(self) -> dict:
        """The contract's reasoning setting as `chat_template_kwargs`: sent to servers known to read it, and to
        any server when thinking is asked for (one that refuses the field then answers with an error)."""
        reasoning = self.arm.reasoning
        if self.reads_chat_template_kwargs or reasoning.enabled:
            return {"chat_template_kwargs": reasoning.template_kwargs()}
        return {}

    def chat(self, conversations: list, params: PromptParams) -> list:
        params_list = params if isinstance(params, list) else [params] * len(conversations)
        extra = {"logprobs": True, "top_logprobs": 0, "return_tokens_as_token_ids": True} if self.return_token_ids else {}
        extra.update(self._template_kwargs())
        jobs = [("/v1/chat/completions", {"model": self.model, "messages": conv, **body_fields(sp), **extra}, True)
                for conv, sp in zip(conversations, params_list)]
        results = self._run_all(jobs)
        return [self._to_output(str(i), None, [], r, sp) for i, (r, sp) in enumerate(zip(results, params_list))]

    def score(self, prompts: list) -> list:
        from onecat.engine.outputs import ScoreOutput

        out = []
        with httpx.Client(base_url=self.base_url, headers=self.headers, timeout=600) as client:
            for p in prompts:
                body = {"model": self.model, "prompt": p, "max_tokens": 1, "echo": True, "logprobs": 0,
                        "temperature": 0.0, "return_tokens_as_token_ids": True}
                r = client.post("/v1/completions", json=self.adjust_body(body))
                if r.status_code != 200:
                    raise EngineUnavailableError(f"{self.base_url} cannot score prompts: HTTP {r.status_code} "
                                                 f"{r.text[:200]}")
                lp = r.json()["choices"][0]["logprobs"]
                toks = lp["tokens"][:-1]
                ids = [int(t.split(":", 1)[1]) if t.startswith("token_id:") else -1 for t in toks]
                out.append(ScoreOutput(ids, [float(x) for x in lp["token_logprobs"][1:-1]]))
        return out

    def metrics(self) -> dict[str, float]:
        """The server's /metrics, parsed (empty when it has none)."""
        try:
            r = httpx.get(self.base_url + "/metrics", headers=self.headers, timeout=10)
            return parse_prometheus(r.text) if r.status_code == 200 else {}
        except httpx.HTTPError:
            return {}

    def info(self) -> dict:
        return {"engine": self.registry_name, "base_url": self.base_url, "served_model": self.model,
                "tokenizer": "local" if not isinstance(self.tokenizer, _RemoteTokenizer) else "server"}


class ManagedServerEngine(OpenAIEndpointEngine):
    """An OpenAI-compatible server the harness starts with the arm's settings, drives over HTTP and stops on
    close(): `onecat serve` here, the peers in peer_servers.py. A subclass says how to start it (`command`),
    which settings it cannot take (`refusals`: each one named, never dropped) and which `engine.options` it
    reads (`OPTIONS`, besides the ones every managed server reads)."""

    log_name = "server"
    ready_path = "/health"
    startup_timeout_s = 600.0
    # read by every managed server: where it listens and logs, how long it may take to start, the client side
    COMMON_OPTIONS = ("port", "log_dir", "startup_timeout_s", "served_model_name", "client_concurrency",
                      "extra_body")
    OPTIONS: tuple[str, ...] = ()

    @classmethod
    def refusals(cls, arm: ArmSettings) -> list[str]:
        """Settings of `arm` this server cannot take, each naming the setting, the backend and the fix."""
        problems = []
        known = cls.COMMON_OPTIONS + cls.OPTIONS
        unknown = sorted(set(arm.engine.options) - set(known))
        if unknown:
            problems.append(f"{cls.registry_name} has no engine.options {', '.join(unknown)}; its options are "
                            f"{', '.join(sorted(known))}")
        if arm.engine.base_url:
            problems.append(f"{cls.registry_name} starts its own server, so engine.base_url is not used: remove "
                            "it, or drive a running server with backend openai")
        return problems

    @classmethod
    def check(cls, arm: ArmSettings) -> list[str]:
        return cls.refusals(arm)

    @classmethod
    def command(cls, arm: ArmSettings, port: int, seed: int) -> tuple[list[str], dict[str, str]]:
        """(argv, extra environment) that start this server for `arm` on `port`."""
        raise NotImplementedError

    @classmethod
    def request_defaults(cls, arm: ArmSettings) -> dict:
        """Fields every request to this server carries unless the request sets them: settings this server takes
        per request, and its own defaults that the contract's settings turn off."""
        return {}

    def adjust_body(self, body: dict) -> dict:
        return {**self.request_defaults(self.arm), **super().adjust_body(body)}

    @classmethod
    def open(cls, arm: ArmSettings, seed: int = 0) -> "ManagedServerEngine":
        from onecat.gates.engines.onecat_engine import _weights_sha256
        from onecat.gates.engines.server_process import free_port

        problems = cls.refusals(arm)
        if problems:
            raise EngineUnavailableError(f"arm {arm.name}: " + "; ".join(problems))
        weights_sha256 = _weights_sha256(arm)  # refuses weights that differ from a model.sha256 pin
        port = int(arm.engine.options.get("port") or free_port())
        argv, env = cls.command(arm, port, seed)
        self = cls.start_managed(arm, seed, argv, port, env=env)
        self.weights_sha256 = weights_sha256
        return self

    @classmethod
    def start_managed(cls, arm: ArmSettings, seed: int, argv: list[str], port: int,
                      env: dict[str, str] | None = None) -> "ManagedServerEngine":
        """Start the server process (its log kept under the arm's log dir), wait until `ready_path` answers,
        then connect to it; a server that exits or never gets ready is an EngineDiedError with its log."""
        from onecat.gates.engines.server_process import ServerProcess, ServerStartError, exit_cause

        log_dir = Path(arm.engine.options.get("log_dir") or os.environ.get("ONECAT_SERVER_LOG_DIR")
                       or Path(".onecat") / "servers" / f"{arm.name}-{arm.fingerprint[:12]}-{int(time.time())}")
        timeout_s = float(arm.engine.options.get("startup_timeout_s", cls.startup_timeout_s))
        proc = ServerProcess(argv, port=port, log_dir=log_dir, name=cls.log_name, env=env,
                             ready_path=cls.ready_path, startup_timeout_s=timeout_s)
        try:
            proc.start()
        except ServerStartError as exc:
            cause = (f"{exit_cause(exc.returncode)} before it was ready" if exc.returncode is not None else
                     f"not ready after {timeout_s:.0f} s")
            raise EngineDiedError(f"arm {arm.name} ({cls.registry_name}): {exc}",
                                  {"cause": cause, "exit_code": exc.returncode, "output_tail": exc.output_tail,
                                   "server_log": str(proc.log_path)}) from None
        try:
            self = cls(arm, proc.url, seed)
        except BaseException:
            proc.stop()
            raise
        self.process = proc
        return self

    def info(self) -> dict:
        info = super().info()
        proc = getattr(self, "process", None)
        if proc is not None:
            info.update(server_log=str(proc.log_path), server_argv=" ".join(proc.argv),
                        server_startup_s=proc.startup_s)
            isa = self.isa_used(proc.log_path.read_text(errors="replace") if proc.log_path.is_file() else "")
            if isa:
                info["isa_used"] = isa
        if getattr(self, "weights_sha256", None):
            info["model_sha256"] = self.weights_sha256
        return info

    def isa_used(self, log_text: str) -> dict | None:
        """The CPU instruction sets this server runs on, where it can be known (gates/engines/isa_report.py),
        from its log so far or by asking its interpreter; None when it cannot."""
        return None

    def failure(self) -> dict | None:
        proc = getattr(self, "process", None)
        failure = proc.exit_failure() if proc is not None else None
        return {**failure, "server_log": str(proc.log_path)} if failure else None

    def close(self) -> None:
        proc = getattr(self, "process", None)
        if proc is not None:
            proc.stop()


@register_engine("onecat_serve")
class ManagedOnecatServer(ManagedServerEngine):
    """Starts `onecat serve` with the arm's settings as flags. Options: `serve_flags` (the server's own settings,
    e.g. max_queue_len, and the engine settings that have no contract key, e.g. kv_cache_memory_gb), `python`
    (the interpreter that runs `-m onecat.cli.main serve`; default: this one)."""

    reads_chat_template_kwargs = True
    log_name = "onecat_serve"
    OPTIONS = ("python", "serve_flags")

    @classmethod
    def _headers(cls, arm: ArmSettings) -> dict:
        key = (arm.engine.options.get("serve_flags") or {}).get("api_key")
        return {"Authorization": f"Bearer {key}"} if key else {}

    @classmethod
    def refusals(cls, arm: ArmSettings) -> list[str]:
        from onecat.engine.server.serve_config import ServeConfig
        from onecat.gates.contract import ENGINE_ARGS_IN_CONTRACT, ENGINE_OPTIONS

        problems = super().refusals(arm)
        set_by_harness = {"model", "host", "port", "served_model_name", "uvicorn_log_level"}
        allowed = (set(ServeConfig.model_fields) - {"engine"} | set(ENGINE_OPTIONS)) - set_by_harness
        for key in arm.engine.options.get("serve_flags") or {}:
            if key in set_by_harness:
                problems.append(f"onecat_serve sets serve_flags.{key} itself (from the model and engine.options); "
                                "remove it")
            elif key in ENGINE_ARGS_IN_CONTRACT and key not in ENGINE_OPTIONS:
                problems.append(f"onecat_serve serve_flags.{key} is a contract setting: set it at "
                                f"{ENGINE_ARGS_IN_CONTRACT[key]}, where the run's fingerprint records it")
            elif key not in allowed:
                problems.append(f"onecat_serve has no serve flag {key!r}; serve_flags takes "
                                f"{', '.join(sorted(allowed))}")
        return problems

    @classmethod
    def check(cls, arm: ArmSettings) -> list[str]:
        from onecat.gates.engines.onecat_engine import preflight

        return cls.refusals(arm) + preflight(arm, arm.engine_args(seed=0, with_options=False))

    @classmethod
    def serve_flags(cls, arm: ArmSettings, seed: int) -> dict:
        """The arm's engine settings as `onecat serve` flags (defaults left out), then options.serve_flags."""
        import json

        flags: dict[str, Any] = arm.engine_args(seed, with_options=False).as_kwargs()
        flags.pop("model")
        if "speculative_config" in flags:
            flags["speculative_config"] = json.dumps(flags["speculative_config"])
        flags["uvicorn_log_level"] = "warning"
        flags.update(arm.engine.options.get("serve_flags", {}))
        return flags

    def isa_used(self, log_text: str) -> dict | None:
        from onecat.gates.engines.isa_report import onecat_serve_isa

        return onecat_serve_isa(log_text)[1]

    @classmethod
    def command(cls, arm: ArmSettings, port: int, seed: int) -> tuple[list[str], dict[str, str]]:
        from onecat.gates.engines.server_process import onecat_serve_argv

        opts = arm.engine.options
        return onecat_serve_argv(arm.model.source, port=port, served_model_name=opts.get("served_model_name"),
                                 flags=cls.serve_flags(arm, seed), python=opts.get("python")), {}
