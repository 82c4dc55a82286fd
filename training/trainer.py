"""The DFlash training loop: many random blocks per sequence, one drafter forward for all of them.

Recipe (DFlash, "Block Diffusion for Flash Speculative Decoding", and SpecForge's DFlash trainer):
- the target's embeddings and lm_head are shared with the drafter and frozen (they are not drafter
  parameters at all); only the drafter's layers, fc, hidden_norm and norm train;
- per sequence, `anchors_per_seq` random anchor positions p in the response; the block of p is
  [token p, MASK x (B-1)] at positions p..p+B-1, its context the target features of positions < p
  (one context per sequence, each block seeing its prefix; all of a step's sequences in one drafter
  forward, `forward_blocks` with one context group per sequence);
- draft k (k = 1..B-1) is lm_head(h[k]) and is scored against token p+k: cross-entropy on the
  target's own token plus `kl_weight` x KL(target || drafter) to the target's full next-token
  distribution there; position k weighs exp(-(k-1)/gamma) (later drafts count less: they are only
  accepted after every earlier one);
- AdamW, linear warm-up then cosine decay, gradient clipping, bf16 autocast on CUDA.
The schedule follows the run's progress: the share of `steps` done or, with a deadline, the share of
the time used, whichever is further; so the cosine decay ends when the run does, whichever ends it.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from onecat.training.features import FeatureSet
from onecat.training.options import TrainOptions

LOG_EVERY_S = 10.0


@dataclass
class Frozen:
    """The target's shared, frozen tensors, in the compute dtype."""

    embed: torch.Tensor  # [V, H]
    lm_head: torch.Tensor  # [V, H]


def position_weights(block_size: int, gamma: float, device) -> torch.Tensor:
    """exp(-(k-1)/gamma) for drafts k = 1..block_size-1."""
    k = torch.arange(1, block_size, device=device, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def response_anchors(data: FeatureSet, seq: int, count: int | None, generator: torch.Generator | None) -> torch.Tensor:
    """Anchor positions (within the sequence) whose first draft is a response token: p in [r, L-2].
    `count` random ones without repetition (all of them when count is None or larger)."""
    r, L = data.response_starts[seq], data.lengths[seq]
    n = L - 1 - r
    if n <= 0:
        return torch.empty(0, dtype=torch.long)
    if count is None or count >= n:
        return torch.arange(r, L - 1)
    return (torch.randperm(n, generator=generator)[:count] + r).sort().values


def draft_hidden(drafter, frozen: Frozen, data: FeatureSet, seqs: list[int], anchors: list[torch.Tensor],
                 dtype: torch.dtype):
    """The drafter's final hidden states for the blocks at `anchors[i]` of sequence `seqs[i]`, all
    sequences in one forward: their contexts are stacked (padded to the longest), each sequence's blocks
    form one group of A rows (padded to the most anchors; padding rows are marked invalid).
    Returns (h [S*A, B-1, H] for drafts 1..B-1, their rows in `data` [S*A, B-1], valid [S*A, B-1])."""
    dev = data.tokens.device
    B, S = drafter.block_size, len(seqs)
    A = max(len(a) for a in anchors)
    C = max(int(a.max()) for a in anchors)  # the context the furthest anchor sees: positions 0..C-1
    starts = torch.tensor([data.starts[q] for q in seqs], device=dev)
    lengths = torch.tensor([data.lengths[q] for q in seqs], device=dev)
    padded = torch.stack([torch.cat([a, a[:1].expand(A - len(a))]) for a in anchors]).to(dev)  # [S, A]
    real = (torch.arange(A) < torch.tensor([len(a) for a in anchors]).unsqueeze(1)).to(dev)  # [S, A]
    rows = starts[:, None] + torch.minimum(torch.arange(C, device=dev)[None], lengths[:, None] - 1)
    ctx = drafter.context(data.features[rows].to(dtype))  # [S, C, H]; rows past an anchor are never seen
    pos = (padded.unsqueeze(-1) + torch.arange(B, device=dev)).view(S * A, B)
    ids = torch.full_like(pos, drafter.mask_token_id)
    ids[:, 0] = data.tokens[(starts[:, None] + padded).view(-1)]
    h = drafter.forward_blocks(F.embedding(ids, frozen.embed), pos, ctx, torch.arange(C, device=dev)[None],
                               padded.view(-1))[:, 1:]
    label_pos = pos[:, 1:]
    seq_len = lengths.repeat_interleave(A).unsqueeze(1)
    valid = (label_pos < seq_len) & real.view(-1, 1)
    return h, starts.repeat_interleave(A).unsqueeze(1) + torch.minimum(label_pos, seq_len - 1), valid


@dataclass
class BlockScores:
    loss: torch.Tensor  # the weighted objective (differentiable)
    ce: float
    kl: float
    correct: torch.Tensor  # [B-1] drafts equal to the sequence's token, per position
    agree: torch.Tensor  # [B-1] drafts equal to the target's argmax, per position
    leading: float  # sum over blocks of the number of leading drafts equal to the target's argmax
    counts: torch.Tensor  # [B-1] valid drafts per position
    blocks: int


def score_blocks(h: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor, data: FeatureSet, frozen: Frozen,
                 weights: torch.Tensor, kl_weight: float) -> BlockScores:
    """Cross-entropy on the sequence's tokens + kl_weight x KL(target || drafter), weighted per position."""
    logq = F.linear(h, frozen.lm_head).float().log_softmax(dim=-1)
    with torch.no_grad():
        logp = F.linear(data.final_hidden[rows - 1].to(frozen.lm_head.dtype), frozen.lm_head).float().log_softmax(-1)
        labels = data.tokens[rows]
    ce = -logq.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    kl = F.kl_div(logq, logp, reduction="none", log_target=True).sum(-1) if kl_weight > 0 else torch.zeros_like(ce)
    w = weights.unsqueeze(0) * valid
    total = w.sum().clamp_min(1e-6)
    loss = ((ce + kl_weight * kl) * w).sum() / total
    with torch.no_grad():
        pred = logq.argmax(-1)
        agree = (pred == logp.argmax(-1)) & valid
        leading = torch.cumprod(agree.int(), dim=1).sum()
        return BlockScores(loss, float((ce * w).sum() / total), float((kl * w).sum() / total),
                           ((pred == labels) & valid).sum(0), agree.sum(0), float(leading), valid.sum(0),
                           int(valid[:, 0].sum()))


class DrafterTrainer:
    def __init__(self, drafter, frozen: Frozen, data: FeatureSet, opts: TrainOptions,
                 log: Callable[[str], None] = print):
        self.drafter, self.frozen, self.data, self.opts, self.log = drafter, frozen, data, opts, log
        self.device = data.tokens.device
        self.dtype = frozen.embed.dtype
        self.autocast = self.device.type == "cuda"
        self.weights = position_weights(drafter.block_size, opts.gamma, self.device)
        self.gen = torch.Generator().manual_seed(opts.seed)
        usable = [i for i in range(len(data)) if data.lengths[i] - 1 - data.response_starts[i] > 0]
        if not usable:
            raise ValueError("no training sequence has a response of 2 or more tokens")
        order = [usable[i] for i in torch.randperm(len(usable), generator=self.gen).tolist()]
        n_hold = min(len(order) - 1, max(1, round(opts.holdout_fraction * len(order)))) if opts.holdout_fraction else 0
        self.heldout, self.train_ids = order[:n_hold], order[n_hold:]
        params = [p for p in drafter.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": opts.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]  # norm weights: no decay
        self.optimizer = torch.optim.AdamW(groups, lr=opts.lr, betas=(0.9, 0.95))
        self.clock: tuple[float, float] | None = None  # (start, deadline) of a time-limited run
        self.history: list[dict] = []
        self.evals: list[dict] = []
        self._epoch: list[int] = []
        self.completed_steps = 0

    # ---- schedule ------------------------------------------------------------------------------
    def progress(self, step: int) -> float:
        """How far the run is at the middle of step `step`: by steps, or by time when that is further."""
        done = (step + 0.5) / self.opts.steps
        if self.clock is not None:
            start, deadline = self.clock
            done = max(done, (time.perf_counter() - start) / max(deadline - start, 1e-9))
        return min(done, 1.0)

    def lr_at(self, progress: float) -> float:
        """Linear warm-up over the first warmup_fraction of the run, then cosine decay to 0."""
        warm = self.opts.warmup_fraction
        if progress < warm:
            return self.opts.lr * progress / warm
        return self.opts.lr * 0.5 * (1 + math.cos(math.pi * (progress - warm) / max(1 - warm, 1e-9)))

    def _next_batch(self) -> list[int]:
        batch = []
        while len(batch) < self.opts.batch_size:
            if not self._epoch:
                self._epoch = [self.train_ids[i] for i in torch.randperm(len(self.train_ids), generator=self.gen)]
            batch.append(self._epoch.pop())
            if len(batch) == len(self.train_ids):
                break
        return batch

    # ---- one step / one evaluation ---------------------------------------------------------------
    def _scores(self, seqs: list[int], count: int | None, generator) -> BlockScores:
        anchors = [response_anchors(self.data, seq, count, generator) for seq in seqs]
        h, rows, valid = draft_hidden(self.drafter, self.frozen, self.data, seqs, anchors, self.dtype)
        return score_blocks(h, rows, valid, self.data, self.frozen, self.weights, self.opts.kl_weight)

    def step(self, step: int) -> BlockScores:
        self.drafter.train()
        lr = self.lr_at(self.progress(step))
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.autocast):
            scores = self._scores(self._next_batch(), self.opts.anchors_per_seq, self.gen)
        self.optimizer.zero_grad(set_to_none=True)
        scores.loss.backward()
        torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.opts.grad_clip)
        self.optimizer.step()
        return scores

    @torch.no_grad()
    def evaluate(self, step: int) -> dict:
        """Held-out per-position accuracy (against the sequence's token and the target's argmax) and the
        mean number of leading drafts equal to the target's argmax (what greedy verification accepts)."""
        self.drafter.eval()
        gen = torch.Generator().manual_seed(self.opts.seed + 1)  # the same blocks at every evaluation
        totals = None
        for i in range(0, len(self.heldout), self.opts.batch_size):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.autocast):
                s = self._scores(self.heldout[i:i + self.opts.batch_size], self.opts.anchors_per_seq, gen)
            part = [s.ce * s.blocks, s.kl * s.blocks, s.correct, s.agree, s.leading, s.counts, s.blocks]
            totals = part if totals is None else [a + b for a, b in zip(totals, part)]
        ce, kl, correct, agree, leading, counts, blocks = totals
        counts = counts.clamp_min(1)
        result = {"step": step, "blocks": blocks, "ce": round(ce / blocks, 4), "kl": round(kl / blocks, 4),
                  "accuracy": [round(x, 4) for x in (correct / counts).tolist()],
                  "target_argmax_agreement": [round(x, 4) for x in (agree / counts).tolist()],
                  "mean_accepted_drafts": round(leading / blocks, 3)}
        self.evals.append(result)
        self.log(f"[eval] step {step}: accepted drafts/block {result['mean_accepted_drafts']:.3f}, "
                 f"accuracy by position {' '.join(f'{a:.2f}' for a in result['accuracy'])}")
        return result

    # ---- the loop ------------------------------------------------------------------------------------
    def run(self, deadline: float | None = None, on_checkpoint: Callable[[int], None] | None = None) -> dict:
        o = self.opts
        t0 = last_log = last_ckpt = time.perf_counter()
        self.clock = (t0, deadline) if deadline is not None else None
        acc = {"loss": 0.0, "ce": 0.0, "kl": 0.0, "n": 0}
        step = 0
        stopped_by = "steps"
        if self.heldout:
            self.evaluate(0)
        while step < o.steps:
            if deadline is not None and time.perf_counter() >= deadline:
                stopped_by = "time_budget"
                break
            lr = self.lr_at(self.progress(step))
            s = self.step(step)
            step += 1
            self.completed_steps = step
            acc["loss"] += float(s.loss.detach())
            acc["ce"] += s.ce
            acc["kl"] += s.kl
            acc["n"] += 1
            now = time.perf_counter()
            if now - last_log >= LOG_EVERY_S or step == o.steps or step % o.eval_every == 0:
                n = acc["n"]
                row = {"step": step, "loss": round(acc["loss"] / n, 4), "ce": round(acc["ce"] / n, 4),
                       "kl": round(acc["kl"] / n, 4), "lr": lr, "elapsed_s": round(now - t0, 1)}
                self.history.append(row)
                self.log(f"[train] step {step} ({self.progress(step - 1):.0%}) loss {row['loss']:.4f} "
                         f"ce {row['ce']:.4f} kl {row['kl']:.4f} lr {lr:.2e} {step / (now - t0):.1f} steps/s")
                acc = {"loss": 0.0, "ce": 0.0, "kl": 0.0, "n": 0}
                last_log = now
            if self.heldout and step % o.eval_every == 0 and step < o.steps:
                self.evaluate(step)
            if on_checkpoint is not None and time.perf_counter() - last_ckpt >= o.checkpoint_every_s:
                on_checkpoint(step)
                last_ckpt = time.perf_counter()
        if self.heldout and (not self.evals or self.evals[-1]["step"] != step):
            self.evaluate(step)
        return {"steps": step, "stopped_by": stopped_by, "seconds": round(time.perf_counter() - t0, 2),
                "train_sequences": len(self.train_ids), "heldout_sequences": len(self.heldout),
                "loss_curve": self.history, "evaluations": self.evals}
