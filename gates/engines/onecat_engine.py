"""The in-process onecat engine (onecat.engine.LLM) behind the adapter interface."""
from __future__ import annotations

from onecat.engine.args import EngineArgs
from onecat.engine.support_matrix.axes import RANDOM_LOAD_FORMATS
from onecat.gates.contract import ArmSettings
from onecat.gates.engines.base import EngineAdapter, PromptParams
from onecat.gates.registry import register_engine


def _resolve(source: str, revision: str | None, weights_required: bool = True) -> str | None:
    """None when the model is found; otherwise the resolver's message (what, where it looked)."""
    try:
        from onecat.engine.model_source import resolve_model_source
    except ImportError as exc:  # pragma: no cover - engine package broken
        return f"onecat engine is not importable ({exc})"
    try:
        resolve_model_source(source, revision, weights_required)
    except Exception as exc:  # ModelNotFoundError and friends carry the fix
        return str(exc)
    return None


def preflight(arm: ArmSettings, args: EngineArgs) -> list[str]:
    """What keeps the onecat engine from running `args` here: settings it does not implement (the engine's
    own list), missing target or drafter files, a CUDA device that is not there. Loads nothing."""
    problems = args.unsupported()
    miss = _resolve(arm.model.source, arm.model.revision, weights_required=args.load_format not in RANDOM_LOAD_FORMATS)
    if miss:
        problems.append(f"target model: {miss}")
    spec = arm.speculative
    if spec is not None and spec.model:
        miss = _resolve(spec.model, spec.revision)
        if miss:
            problems.append(f"drafter model: {miss}")
    gpus = _cuda_count() if args.device.startswith("cuda") else None
    if gpus == 0:
        problems.append("engine.device is cuda but no CUDA device is visible")
    if gpus is not None and args.tensor_parallel_size > gpus:
        problems.append(f"tensor_parallel_size {args.tensor_parallel_size} needs {args.tensor_parallel_size} GPUs "
                        f"of one host; {gpus} are visible here")
    return problems


@register_engine("onecat")
class OnecatEngine(EngineAdapter):
    takes_engine_args = True  # the contract's engine settings are EngineArgs (contract check validates options)

    @classmethod
    def check(cls, arm: ArmSettings) -> list[str]:
        return preflight(arm, arm.engine_args(seed=0))

    @classmethod
    def open(cls, arm: ArmSettings, seed: int = 0) -> "OnecatEngine":
        return cls(arm, seed)

    def __init__(self, arm: ArmSettings, seed: int = 0):
        from onecat.engine import LLM

        self.template_kwargs = arm.reasoning.template_kwargs()
        args = arm.engine_args(seed)
        random_weights = args.load_format in RANDOM_LOAD_FORMATS
        self.model_sha256 = None if random_weights else _weights_sha256(arm)  # random: no weights
        self.llm = LLM(**args.as_kwargs())
        self.tokenizer = self.llm.tokenizer
        self.vocab_size = self._vocab_size()

    def _vocab_size(self) -> int | None:
        info = self.info()
        for k in ("vocab_size", "num_tokens"):
            if isinstance(info.get(k), int):
                return info[k]
        tok = self.tokenizer
        for attr in ("vocab_size", "n_vocab"):
            v = getattr(tok, attr, None)
            if isinstance(v, int):
                return v
        try:
            return len(tok)
        except TypeError:
            return None

    def generate(self, prompts: list, params: PromptParams) -> list:
        return self.llm.generate(prompts, params)

    def chat(self, conversations: list, params: PromptParams) -> list:
        return self.llm.chat(conversations, params, **self.template_kwargs)

    def score(self, prompts: list) -> list:
        return self.llm.score(prompts)

    def info(self) -> dict:
        try:
            info = dict(self.llm.info())
        except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
            info = {"info_error": f"{type(exc).__name__}: {exc}"}
        if "model_sha256" not in info and self.model_sha256:
            info["model_sha256"] = self.model_sha256
        return info

    def close(self) -> None:
        self.llm.close()


_HASHES: dict[tuple, str] = {}
HASH_LIMIT_BYTES = 4 << 30  # hash weights up to this size when recording a run (bigger: pin via model.sha256)


def _weights_sha256(arm: ArmSettings) -> str | None:
    """sha256 of the target weights, checked against the contract's model.sha256 pin when given."""
    from onecat.engine.model_source import resolve_model_source
    from onecat.gates.engines.base import EngineUnavailableError

    resolved = resolve_model_source(arm.model.source, arm.model.revision)
    files = [resolved.path] if resolved.format == "gguf" else list(resolved.path.glob("*.safetensors"))
    if arm.model.sha256 is None and sum(f.stat().st_size for f in files) > HASH_LIMIT_BYTES:
        return None
    key = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    if key not in _HASHES:  # both arms usually share the weights: hash once per process
        _HASHES[key] = resolved.sha256()
    digest = _HASHES[key]
    if arm.model.sha256 is not None and digest != arm.model.sha256:
        raise EngineUnavailableError(f"arm {arm.name}: model {arm.model.source} has sha256 {digest}, the contract "
                                     f"pins {arm.model.sha256}; refusing to measure different weights")
    return digest


def _cuda_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001
        return 0
