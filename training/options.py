"""Every setting of a drafter training run, with the recipe's defaults, validated in one place.

The defaults are the recipe for the embedded SmolLM2-135M-Instruct target (30 layers, hidden 576):
block size 8 (the size acceptance is measured at), 5 tap layers spread over the depth as public DFlash
drafters choose them, 3 drafter layers shaped like the target's (about 24.6 MB in bf16), the loss
weights of the DFlash paper for block size 8 (gamma 4) and the regeneration budget of a run that fits
one ~8-minute GPU command. Each field's help says what it controls.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from onecat.engine.errors import ConfigError

DEFAULT_DATA = "sharegpt:8000"  # the prompt set of the shipped recipe
NUM_TAPS = 5  # tap layers chosen when target_layer_ids is not given


def opt(default, help: str):
    """A TrainOptions field with its help text (the CLI makes one flag per field from these)."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class TrainOptions:
    # drafter shape
    block_size: int = opt(8, "tokens per drafted block: the anchor and block_size - 1 drafts")
    target_layer_ids: tuple[int, ...] | None = opt(
        None, f"target layers (ascending) whose outputs condition the drafter; default: {NUM_TAPS} spread over "
              "[1, layers - 3]")
    num_layers: int = opt(3, "drafter layers")
    intermediate_size: int | None = opt(None, "drafter MLP width; default: the target's")
    mask_token_id: int | None = opt(None, "token of the masked block positions; default: a special token of "
                                          "the target that chat text never holds")
    # optimisation
    steps: int = opt(6000, "optimizer steps (fewer when the time budget ends the run first)")
    batch_size: int = opt(16, "sequences per step")
    anchors_per_seq: int = opt(64, "blocks per sequence per step (random anchors in the response)")
    lr: float = opt(6e-4, "peak AdamW learning rate")
    warmup_fraction: float = opt(0.04, "linear warm-up share of the run (of steps or of the time budget), "
                                       "then cosine decay to 0")
    weight_decay: float = opt(0.01, "AdamW weight decay")
    gamma: float = opt(4.0, "draft k weighs exp(-(k-1)/gamma) (DFlash: 4 for block size 8, 7 for 16)")
    kl_weight: float = opt(0.5, "weight of KL(target || drafter) next to the cross-entropy on the target's tokens")
    grad_clip: float = opt(1.0, "gradient norm clip")
    seed: int = opt(0, "seed of the prompt choice, sampled responses, anchors and initialisation")
    holdout_fraction: float = opt(0.02, "share of sequences kept out of training to measure per-position accuracy")
    eval_every: int = opt(250, "steps between held-out evaluations")
    # regeneration (responses written by the target itself)
    max_new_tokens: int = opt(256, "longest regenerated response, in tokens")
    sampled_fraction: float = opt(0.25, "share of prompts answered by sampling instead of greedily")
    extra_sampled_answers: int = opt(0, "sampled answers per prompt on top of its first answer (greedy or "
                                        "sampled), each with its own seed; exact repeats are kept once")
    temperature: float = opt(0.8, "temperature of the sampled responses")
    top_p: float = opt(0.95, "top_p of the sampled responses")
    min_prompt_tokens: int = opt(4, "shortest ShareGPT prompt, in target tokens")
    max_prompt_tokens: int = opt(384, "longest ShareGPT prompt, in target tokens")
    regen_batch: int = opt(256, "sequences the engine decodes together (max_num_seqs)")
    # machine and time
    device: str = opt("auto", "auto | cpu | cuda | cuda:N")
    target_dtype: str = opt("auto", "the target's dtype while regenerating and capturing features")
    kv_cache_memory_gb: float | None = opt(None, "engine KV budget in GiB; default: 16 on CUDA, the engine's on CPU")
    time_budget_s: float | None = opt(None, "wall clock of the whole run; training stops early and still saves")
    regen_share: float = opt(0.45, "share of the time budget that regeneration may use")
    checkpoint_every_s: float = opt(60.0, "a loadable drafter is saved at least this often while training")
    samples_file: str | None = opt(None, "regenerated responses kept on disk: read instead of regenerating when "
                                         "it exists (made for the same target, prompts and settings), written after "
                                         "regeneration when it does not; NAME.jsonl is JSON lines, any other path a "
                                         "folder of compressed parts of at most 15 MiB (for size-limited transfers)")
    regenerate_only: bool = opt(False, "stop once the responses are regenerated and saved in samples_file (which "
                                       "it needs), using the whole time budget: a run cut by its budget is "
                                       "continued by the next one, and a later run trains on the samples")
    init_from: str | None = opt(None, "continue training this drafter directory (config.json + model.safetensors) "
                                      "instead of a random one; its block size, layers, tap layers and mask token "
                                      "must equal the options'")

    def __post_init__(self) -> None:
        problems = []
        positive_ints = ("block_size", "num_layers", "steps", "batch_size", "anchors_per_seq", "eval_every",
                         "max_new_tokens", "min_prompt_tokens", "max_prompt_tokens", "regen_batch")
        problems += [f"{n}={getattr(self, n)} must be a positive integer" for n in positive_ints
                     if not isinstance(getattr(self, n), int) or getattr(self, n) < 1]
        if self.block_size < 2:
            problems.append(f"block_size={self.block_size}: a block holds the anchor and at least one draft (>= 2)")
        if self.min_prompt_tokens > self.max_prompt_tokens:
            problems.append(f"min_prompt_tokens {self.min_prompt_tokens} > max_prompt_tokens {self.max_prompt_tokens}")
        ids = self.target_layer_ids
        if ids is not None and (not ids or list(ids) != sorted(set(ids)) or min(ids) < 0):
            problems.append(f"target_layer_ids {list(ids)} must be distinct, ascending, non-negative layer indices "
                            "(the engine hands the drafter the tapped layers in ascending order)")
        for name, lo, hi in (("warmup_fraction", 0, 1), ("sampled_fraction", 0, 1), ("holdout_fraction", 0, 0.5),
                             ("regen_share", 0.05, 0.95), ("top_p", 1e-6, 1)):
            if not lo <= getattr(self, name) <= hi:
                problems.append(f"{name}={getattr(self, name)} must be within [{lo}, {hi}]")
        for name in ("lr", "gamma", "temperature", "grad_clip", "checkpoint_every_s"):
            if not getattr(self, name) > 0:
                problems.append(f"{name}={getattr(self, name)} must be > 0")
        if not isinstance(self.extra_sampled_answers, int) or self.extra_sampled_answers < 0:
            problems.append(f"extra_sampled_answers={self.extra_sampled_answers} must be an integer >= 0")
        for name in ("kl_weight", "weight_decay"):
            if getattr(self, name) < 0:
                problems.append(f"{name}={getattr(self, name)} must be >= 0")
        if self.time_budget_s is not None and self.time_budget_s <= 0:
            problems.append(f"time_budget_s={self.time_budget_s} must be > 0 (or unset: no limit)")
        if self.intermediate_size is not None and self.intermediate_size < 1:
            problems.append(f"intermediate_size={self.intermediate_size} must be a positive integer")
        if self.regenerate_only and not self.samples_file:
            problems.append("regenerate_only needs samples_file: where the regenerated responses are kept")
        if problems:
            raise ConfigError("; ".join(problems))

    @classmethod
    def create(cls, **options) -> "TrainOptions":
        """TrainOptions from keyword options; an unknown name is a ConfigError listing the known ones."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(f"unknown training option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        if options.get("target_layer_ids") is not None:
            options["target_layer_ids"] = tuple(int(i) for i in options["target_layer_ids"])
        return cls(**options)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["target_layer_ids"] = list(self.target_layer_ids) if self.target_layer_ids is not None else None
        return d


def spread_layer_ids(num_target_layers: int, count: int = NUM_TAPS) -> list[int]:
    """`count` layers evenly spread over [1, num_target_layers - 3], as public DFlash drafters pick them
    (one tap: the middle layer). Fewer when the target has too few layers for `count` distinct ones."""
    if count == 1 or num_target_layers < 4:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return sorted({int(round(start + i * (end - start) / (count - 1))) for i in range(count)})
