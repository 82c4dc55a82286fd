"""`onecat serve MODEL`: the OpenAI-compatible server, with `vllm serve`'s flag names."""
from __future__ import annotations

import json
from typing import List, Optional

import typer

app = typer.Typer(help="Serve a model over the OpenAI API (/v1/completions, /v1/chat/completions, /metrics).",
                  no_args_is_help=True, add_completion=False,
                  context_settings={"allow_interspersed_args": True})


@app.callback(invoke_without_command=True)
def serve(model: str = typer.Argument(..., help="embedded:NAME, an HF directory, a .gguf file or a cached hub id"),
          host: str = typer.Option("127.0.0.1", "--host"),
          port: int = typer.Option(8000, "--port"),
          served_model_name: Optional[List[str]] = typer.Option(None, "--served-model-name",
                                                                help="name(s) clients use; default: MODEL"),
          max_model_len: Optional[int] = typer.Option(None, "--max-model-len"),
          kv_cache_dtype: str = typer.Option("auto", "--kv-cache-dtype", help="auto | fp8_e4m3 | fp8_e5m2"),
          quantization: Optional[str] = typer.Option(None, "--quantization", "-q",
                                                     help="gguf: keep a GGUF's Q4_0/Q4_1/Q8_0 tensors packed"),
          enable_prefix_caching: bool = typer.Option(True, "--enable-prefix-caching/--no-enable-prefix-caching"),
          speculative_config: Optional[str] = typer.Option(None, "--speculative-config",
                                                           help='JSON, e.g. {"method": "ngram", '
                                                                '"num_speculative_tokens": 4}'),
          api_key: Optional[str] = typer.Option(None, "--api-key", envvar="ONECAT_API_KEY",
                                                help="require `Authorization: Bearer KEY` on every route but "
                                                     "/health and /ping"),
          metrics_without_auth: bool = typer.Option(False, "--metrics-without-auth/--no-metrics-without-auth",
                                                    help="serve /metrics without the API key"),
          tensor_parallel_size: int = typer.Option(1, "--tensor-parallel-size", "-tp"),
          max_num_seqs: int = typer.Option(64, "--max-num-seqs"),
          max_num_batched_tokens: int = typer.Option(2048, "--max-num-batched-tokens"),
          dtype: str = typer.Option("auto", "--dtype"),
          seed: int = typer.Option(0, "--seed"),
          device: str = typer.Option("auto", "--device", help="auto | cpu | cuda"),
          max_queue_len: int = typer.Option(1024, "--max-queue-len",
                                            help="requests allowed to wait beyond --max-num-seqs; more get 503"),
          reasoning_parser: str = typer.Option("think", "--reasoning-parser",
                                               help="think: <think>...</think> -> reasoning_content; none: off"),
          num_kv_blocks: Optional[int] = typer.Option(None, "--num-kv-blocks", help="fix the KV cache size"),
          max_request_body_bytes: int = typer.Option(16 * 2**20, "--max-request-body-bytes",
                                                     help="larger request bodies get 413"),
          request_header_timeout: float = typer.Option(10.0, "--request-header-timeout",
                                                       help="seconds for a request line and headers to arrive; "
                                                            "slower connections are closed"),
          request_body_timeout: float = typer.Option(60.0, "--request-body-timeout",
                                                     help="seconds for a whole request body to arrive; else 408"),
          timeout_keep_alive: float = typer.Option(5.0, "--timeout-keep-alive",
                                                   help="close idle keep-alive connections after this many seconds"),
          limit_concurrency: int = typer.Option(2048, "--limit-concurrency",
                                                help="open connections + requests in progress beyond which new "
                                                     "requests get 503; 0: no limit"),
          h11_max_incomplete_event_size: Optional[int] = typer.Option(
              None, "--h11-max-incomplete-event-size", help="bytes of request line + headers (default 16 KiB)"),
          uvicorn_log_level: str = typer.Option("info", "--uvicorn-log-level")) -> None:
    """Start the server. Exit codes: 2 bad flags, 4 the model or device is missing."""
    from onecat.engine.errors import EngineError
    from onecat.engine.server.app import ServeConfig
    from onecat.engine.server.launch import serve as run

    if tensor_parallel_size != 1:
        typer.echo(f"error: --tensor-parallel-size {tensor_parallel_size} is not supported; onecat serve runs "
                   "one device per server (use --tensor-parallel-size 1)", err=True)
        raise typer.Exit(2)
    if reasoning_parser not in ("think", "none", "qwen3", "deepseek_r1"):
        typer.echo("error: --reasoning-parser must be think, qwen3, deepseek_r1 or none", err=True)
        raise typer.Exit(2)
    for flag, value in (("--max-request-body-bytes", max_request_body_bytes),
                        ("--request-header-timeout", request_header_timeout),
                        ("--request-body-timeout", request_body_timeout), ("--timeout-keep-alive", timeout_keep_alive),
                        ("--h11-max-incomplete-event-size", h11_max_incomplete_event_size or 1)):
        if not value > 0:
            typer.echo(f"error: {flag} must be positive, got {value}", err=True)
            raise typer.Exit(2)
    if limit_concurrency < 0:
        typer.echo(f"error: --limit-concurrency must be >= 0 (0: no limit), got {limit_concurrency}", err=True)
        raise typer.Exit(2)
    spec = None
    if speculative_config:
        try:
            spec = json.loads(speculative_config)
        except json.JSONDecodeError as exc:
            typer.echo(f"error: --speculative-config is not valid JSON ({exc}); e.g. "
                       '\'{"method": "ngram", "num_speculative_tokens": 4}\'', err=True)
            raise typer.Exit(2)
        if not isinstance(spec, dict):
            typer.echo("error: --speculative-config must be a JSON object", err=True)
            raise typer.Exit(2)
    cfg = ServeConfig(model=model, served_model_name=list(served_model_name or []), host=host, port=port,
                      api_key=api_key, metrics_without_auth=metrics_without_auth,
                      max_model_len=max_model_len, kv_cache_dtype=kv_cache_dtype,
                      quantization=quantization,
                      enable_prefix_caching=enable_prefix_caching, speculative_config=spec,
                      tensor_parallel_size=tensor_parallel_size, max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=max_num_batched_tokens, dtype=dtype, seed=seed, device=device,
                      max_queue_len=max_queue_len,
                      reasoning_parser="none" if reasoning_parser == "none" else "think",
                      max_request_body_bytes=max_request_body_bytes, request_header_timeout=request_header_timeout,
                      request_body_timeout=request_body_timeout, timeout_keep_alive=timeout_keep_alive,
                      limit_concurrency=limit_concurrency or None,
                      h11_max_incomplete_event_size=h11_max_incomplete_event_size,
                      llm_kwargs={"num_kv_blocks": num_kv_blocks} if num_kv_blocks else {})
    try:
        run(cfg, log_level=uvicorn_log_level)
    except EngineError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(4)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
