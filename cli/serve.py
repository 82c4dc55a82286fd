"""`onecat serve MODEL`: the OpenAI-compatible server, with `vllm serve`'s flag names.

The flags are generated: one per EngineArgs field (engine/args.py) and one per server setting
(engine/server/serve_config.py), so a setting, its default and its help are declared once.
"""
from __future__ import annotations

import inspect
import typing
from typing import Any, List, Optional

import typer
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from onecat.engine.args import EngineArgs, describe_errors
from onecat.engine.server.serve_config import ServeConfig

EXIT_BAD_FLAGS, EXIT_MISSING = 2, 4
SERVER_FIELDS = [name for name in ServeConfig.model_fields if name != "engine"]

app = typer.Typer(help="Serve a model over the OpenAI API (/v1/completions, /v1/chat/completions, /metrics).",
                  no_args_is_help=True, add_completion=False,
                  context_settings={"allow_interspersed_args": True})


def flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


def _option(name: str, field: FieldInfo, panel: str) -> inspect.Parameter:
    """A typer option for one settings field: its flag (plus `flags` aliases), type, choices, default, help."""
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    kind = field.annotation
    if typing.get_origin(kind) is typing.Union:  # Optional[X] -> X
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    default = None if field.default is None or field.default_factory else field.default
    decls = [flag_of(name), *extra.get("flags", [])]
    if kind is bool:
        decls = [f"{flag_of(name)}/--no-{flag_of(name)[2:]}"]
    elif isinstance(kind, type) and issubclass(kind, BaseModel):
        kind = str  # given as JSON text
    elif typing.get_origin(kind) is list:
        kind = List[str]
    info = typer.Option(default, *decls, help=field.description, rich_help_panel=panel,
                        envvar=extra.get("envvar"), show_default=default is not None)
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=Optional[kind])


def _signature() -> inspect.Signature:
    model = EngineArgs.model_fields["model"]
    params = [inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=str,
                                default=typer.Argument(..., help=model.description))]
    params += [_option(n, f, "Engine") for n, f in EngineArgs.model_fields.items() if n != "model"]
    params += [_option(n, ServeConfig.model_fields[n], "Server") for n in SERVER_FIELDS]
    params.append(inspect.Parameter("uvicorn_log_level", inspect.Parameter.KEYWORD_ONLY, annotation=str,
                                    default=typer.Option("info", "--uvicorn-log-level", rich_help_panel="Server")))
    return inspect.Signature(params)


def _fail(message: str, code: int) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


def serve_config(flags: dict[str, Any]) -> ServeConfig:
    """The server's config from parsed flags; a bad value is a typer.Exit(2) naming its flag."""
    engine = {n: flags[n] for n in EngineArgs.model_fields if flags.get(n) is not None}
    if "speculative_config" in engine:
        import json

        try:
            engine["speculative_config"] = json.loads(engine["speculative_config"])
        except json.JSONDecodeError as exc:
            raise _fail(f"--speculative-config is not valid JSON ({exc}); e.g. "
                        '\'{"method": "ngram", "num_speculative_tokens": 4}\'', EXIT_BAD_FLAGS) from None
    server = {n: flags[n] for n in SERVER_FIELDS if flags.get(n) is not None}
    try:
        args = EngineArgs(**engine)
        return ServeConfig(engine=args, **server)
    except ValidationError as exc:
        raise _fail(describe_errors(exc, "flag", spell=flag_of), EXIT_BAD_FLAGS) from None


def serve(**flags: Any) -> None:
    """Start the server. Exit codes: 2 bad flags (or a setting the engine does not implement), 4 the model or
    device is missing."""
    from onecat.engine.errors import EngineError
    from onecat.engine.server.launch import serve as run

    log_level = flags.pop("uvicorn_log_level")
    cfg = serve_config(flags)
    unsupported = cfg.engine.unsupported()
    if unsupported:
        raise _fail("; ".join(unsupported), EXIT_BAD_FLAGS)
    try:
        run(cfg, log_level=log_level)
    except EngineError as exc:
        raise _fail(str(exc), EXIT_MISSING) from None
    except ValueError as exc:
        raise _fail(str(exc), EXIT_BAD_FLAGS) from None


serve.__signature__ = _signature()  # type: ignore[attr-defined]
app.callback(invoke_without_command=True)(serve)
