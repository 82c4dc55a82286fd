"""A harness engine as an lm-eval model, so any lm-eval task runs on either arm of a contract.

lm-eval asks three things of a model: the loglikelihood of a continuation after a context (and
whether it is the greedy continuation), the rolling loglikelihood of a whole text, and generations
until stop strings. Here they map onto the engine's own requests: a prompt scored with
`prompt_logprobs=1` gives every position's logprob and rank (rank 1: the argmax), so one scoring pass
answers loglikelihood and `is_greedy` together; generation is greedy unless the task asks otherwise.
Tokenization follows lm-eval's (context and continuation split as in its `_encode_pair`: trailing
spaces of the context move to the continuation; an empty context is preceded by the EOS token).

lm-eval is imported only when a bridge is built (it is a test dependency, not an engine one).
`register()` also names it `onecat` in lm-eval's model registry, for `simple_evaluate(model="onecat")`;
`python -m onecat.gates.tasks.lm_eval_bridge` is lm-eval's own command line with `onecat` registered.
"""
from __future__ import annotations

from typing import Any

from onecat.engine.sampling_params import SamplingParams
from onecat.gates.engines.base import Engine


def encode_pair(tokenizer: Any, context: str, continuation: str, prefix_id: int) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as lm-eval splits them."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation)
    ctx = tokenizer.encode(context) if context else []
    cont = whole[len(ctx):]
    return (ctx or [prefix_id]), cont


def make_lm(engine: Engine, max_gen_toks: int = 256):
    """An lm-eval `LM` over a harness engine adapter (its generate(prompts, params) and tokenizer)."""
    from lm_eval.api.model import LM

    tokenizer = engine.tokenizer
    window = int(engine.info().get("max_model_len") or 2048) - 1  # tokens predicted per scoring request
    eos = list(getattr(tokenizer, "eos_token_ids", None) or [getattr(tokenizer, "eos_token_id", 0)])[0]

    class OnecatLM(LM):
        def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
            pairs = [encode_pair(tokenizer, *r.args, prefix_id=eos) for r in requests]
            params = SamplingParams(temperature=0.0, max_tokens=0, prompt_logprobs=1)
            outs = engine.generate([ctx + cont for ctx, cont in pairs], [params] * len(pairs))
            result = []
            for (ctx, cont), out in zip(pairs, outs):
                if out.error:
                    raise RuntimeError(f"the engine failed a scoring request: {out.error}")
                lps, ranks = out.prompt_logprobs[len(ctx):], out.prompt_ranks[len(ctx):]
                result.append((float(sum(lps)), all(r == 1 for r in ranks)))
            return result

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
            """Disjoint windows of at most max_model_len tokens, each after one token of context (the
            EOS before the text, then the window's predecessor), as lm-eval's rolling windows."""
            totals = []
            for r in requests:
                tokens = [eos] + tokenizer.encode(r.args[0])
                windows = [tokens[start - 1:start + window] for start in range(1, len(tokens), window)]
                totals.append(float(sum(sum(o.logprobs) for o in engine.score(windows))))
            return totals

        def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
            params = []
            for r in requests:
                kwargs = dict(r.args[1])
                until = kwargs.pop("until", None) or []
                params.append(SamplingParams(temperature=float(kwargs.pop("temperature", 0.0)),
                                             max_tokens=int(kwargs.pop("max_gen_toks", max_gen_toks)),
                                             stop=[until] if isinstance(until, str) else list(until)))
            outs = engine.generate([r.args[0] for r in requests], params)
            for out in outs:
                if out.error:
                    raise RuntimeError(f"the engine failed a generation request: {out.error}")
            return [out.text for out in outs]

    return OnecatLM()


def register() -> None:
    """Name the bridge `onecat` in lm-eval's registry: `model_args` pretrained=MODEL (any LLM setting
    may follow, e.g. device=cpu,dtype=float32)."""
    from lm_eval.api.model import LM
    from lm_eval.api.registry import model_registry

    if "onecat" in model_registry.keys():
        return

    class OnecatModel(LM):
        @classmethod
        def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
            from lm_eval.utils import simple_parse_args_string

            return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

        @classmethod
        def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
            from onecat.engine import LLM

            settings = dict(arg_dict)
            model = settings.pop("pretrained")
            for key in ("batch_size", "max_batch_size", "device_map"):
                settings.pop(key, None)
            llm = LLM(model, **settings)
            return make_lm(llm)

    model_registry.register("onecat", target=OnecatModel)


def main() -> None:
    """`python -m onecat.gates.tasks.lm_eval_bridge --model onecat --model_args pretrained=MODEL ...`: lm-eval's
    own command line, with `onecat` registered first (lm-eval 0.4 has no plugin entry point for models)."""
    from lm_eval.__main__ import cli_evaluate

    register()
    cli_evaluate()


if __name__ == "__main__":
    main()
