"""Train the bundled tiny DeepSeek-V3-shaped model on the Python standard library.

The checkpoint this writes (default ``bundled/tiny-v3/``) is what ``preload.BUNDLED_MODEL``
points at: a real ``DeepseekV3ForCausalLM`` HF directory (MLA, routed + shared experts,
a dense first layer, one MTP layer) small enough to commit (< 10 MB) that has actually
learned something, so demos print plausible Python, quantization quality can be
measured, and the MTP draft gets accepted during speculative decoding.

Everything runs on CPU (2 threads), about 12 minutes on an idle 2-core machine
(0.70 s a step); the bundled checkpoint came from

    .venv/bin/python scripts/train_tiny.py --minutes 25 --steps 950

(`--steps` fixes the schedule, so the result does not depend on the machine's load;
`--minutes` only caps the loop's wall time.)

The data is the stdlib's own ``.py`` files because they exist on every machine with
Python; a fixed held-out sample is also written to ``tests/data/heldout.txt`` so tests
do not depend on the local stdlib version.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import sysconfig
import time
from pathlib import Path

# Threads that sleep rather than spin at OpenMP barriers: on a shared (loaded) 2-core
# machine, spinning threads made steps up to 10x slower; sleeping costs little when idle.
# Must be set before torch starts OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from tiny_checkpoint import README_TEMPLATE, checkpoint_names, draft_config, model_config  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from tiny_corpus import (  # noqa: E402
    HELDOUT_SAMPLE_BYTES,
    collect_sources,
    heldout_sample,
    is_heldout,
    token_stream,
    tokenizer_config,
    train_tokenizer,
)

REPO = Path(__file__).resolve().parent.parent

VOCAB_SIZE = 2048
SEQ_LEN = 512
EVAL_WINDOWS = 48  # fixed held-out 512-token windows for the reported loss
MTP_LOSS_WEIGHT = 0.3  # DeepSeek-V3's lambda for the MTP loss in its early training phase
# Step size of the aux-loss-free balancing bias. DeepSeek-V3 uses 0.001 over ~10^5 steps;
# our run has a few hundred, so a larger step lets the bias actually move.
BIAS_UPDATE_SPEED = 0.002
SIZE_LIMIT_BYTES = 10_000_000


# ------------------------------------------------------------------------- training


def init_weights(cfg, seed: int = 0, std: float = 0.02) -> dict[str, torch.Tensor]:
    """Fresh float32 weights for `cfg` (a ModelConfig), under the checkpoint's names:
    normal(0, std) matrices, unit norms, zero router biases."""
    from preload.checkpoint.shapes import checkpoint_shapes

    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in checkpoint_shapes(cfg, with_mtp=cfg.num_mtp_layers > 0).items():
        if name.endswith("e_score_correction_bias"):
            weights[name] = torch.zeros(shape)
        elif len(shape) == 1:
            weights[name] = torch.ones(shape)
        else:
            weights[name] = torch.randn(shape, generator=gen) * std
    return weights


def train_forward(model, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logits [B, S, V] and MTP logits [B, S-1, V] of the serving model (a
    worker.model.deepseek.Transformer) for full sequences [B, S]: every sequence in one
    flat batch over a throwaway latent cache. MTP position i predicts token i+2."""
    from preload.worker.model.kv_cache import AttentionMeta, LatentCache

    b, s = tokens.shape
    cache = LatentCache(model.num_cache_layers, b * s, model.cfg, model.embed.dtype, tokens.device)
    meta = AttentionMeta.build([(0, s, [row]) for row in range(b)], s, tokens.device)  # one cache block per row
    hidden = model.forward(tokens.flatten(), meta, cache)
    logits = model.logits(hidden).view(b, s, -1)
    if model.mtp is None:
        return logits, None
    mtp_meta = AttentionMeta.build([(0, s - 1, [row]) for row in range(b)], s, tokens.device)
    h = hidden.view(b, s, -1)[:, :-1].flatten(0, 1)
    mtp_logits = model.mtp_forward(h, tokens[:, 1:].flatten(), mtp_meta, cache)
    return logits, mtp_logits.view(b, s - 1, -1)


class ExpertLoads:
    """Counts how many tokens each MoE layer routes to each expert, by wrapping the
    layers' `route` (the model itself does not report loads), so the training loop can
    apply DeepSeek-V3's aux-loss-free balancing to `e_score_correction_bias`."""

    def __init__(self, model, n_experts: int):
        from preload.worker.model.deepseek import MoE

        blocks = list(model.layers) + ([model.mtp.block] if model.mtp is not None else [])
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []  # (bias, counts) per MoE layer
        for block in blocks:
            moe = block.ffn
            if isinstance(moe, MoE):
                counts = torch.zeros(n_experts)
                moe.route = self._counting(moe.route, counts)  # instance attribute shadows the method
                self.layers.append((moe.bias, counts))

    @staticmethod
    def _counting(route, counts: torch.Tensor):
        def counted(x: torch.Tensor):
            weights, ids = route(x)
            counts.add_(torch.bincount(ids.flatten(), minlength=counts.numel()).float())
            return weights, ids

        return counted

    def reset(self) -> None:
        for _, counts in self.layers:
            counts.zero_()

    @torch.no_grad()
    def update_bias(self, speed: float) -> None:
        """bias_e += speed * sign(mean load - load_e): underloaded experts get chosen more."""
        for bias, counts in self.layers:
            bias.add_(speed * torch.sign(counts.mean() - counts))

    def imbalance(self) -> float:
        """Worst max/mean load over the MoE layers (1.0 = perfectly balanced)."""
        return max((c.max() / c.mean().clamp(min=1)).item() for _, c in self.layers) if self.layers else 1.0


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warmup, then cosine decay to 10% of peak over the planned steps."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def sample_batch(stream: torch.Tensor, batch: int, gen: torch.Generator) -> torch.Tensor:
    """Random SEQ_LEN windows of the concatenated train stream."""
    starts = torch.randint(0, len(stream) - SEQ_LEN, (batch,), generator=gen)
    return torch.stack([stream[s : s + SEQ_LEN] for s in starts.tolist()])


def losses(model, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Mean next-token CE of the main head and next-next-token CE of the MTP head."""
    logits, mtp_logits = train_forward(model, tokens)
    v = logits.shape[-1]
    main = F.cross_entropy(logits[:, :-1].reshape(-1, v).float(), tokens[:, 1:].reshape(-1))
    mtp = None
    if mtp_logits is not None:
        mtp = F.cross_entropy(mtp_logits[:, :-1].reshape(-1, v).float(), tokens[:, 2:].reshape(-1))
    return main, mtp


@torch.no_grad()
def evaluate(model, windows: torch.Tensor, batch: int) -> tuple[float, float | None]:
    """Mean CE over fixed windows (each window weighs the same: all are full length)."""
    main_sum, mtp_sum, n = 0.0, 0.0, 0
    for i in range(0, len(windows), batch):
        chunk = windows[i : i + batch]
        main, mtp = losses(model, chunk)
        main_sum += main.item() * len(chunk)
        mtp_sum += (mtp.item() if mtp is not None else math.nan) * len(chunk)
        n += len(chunk)
    return main_sum / n, (mtp_sum / n if not math.isnan(mtp_sum) else None)


def eval_windows(stream: torch.Tensor, count: int) -> torch.Tensor:
    """Non-overlapping SEQ_LEN windows, evenly spread over the held-out stream."""
    n_avail = len(stream) // SEQ_LEN
    picks = sorted({int(i * n_avail / count) for i in range(count)}) if n_avail > count else range(n_avail)
    return torch.stack([stream[p * SEQ_LEN : (p + 1) * SEQ_LEN] for p in picks])


# ----------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "bundled" / "tiny-v3")
    ap.add_argument("--minutes", type=float, default=11.0, help="time budget of the training loop")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=None, help="planned steps (default: fit the budget)")
    ap.add_argument("--batch", type=int, default=4, help="sequences of 512 tokens per step")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--heldout-txt", type=Path, default=REPO / "tests" / "data" / "heldout.txt")
    ap.add_argument("--draft-of", type=Path, default=None,
                    help="train a draft model (draft_config) with that checkpoint's tokenizer instead")
    args = ap.parse_args()

    t_start = time.time()
    torch.set_num_threads(2)
    torch.manual_seed(args.seed)
    random.seed(args.seed)

    def log(msg: str) -> None:
        print(f"[{time.time() - t_start:7.1f}s] {msg}", flush=True)

    # --- data
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs = collect_sources(stdlib)
    train_docs = [t for p, t in docs if not is_heldout(p)]
    held_docs = [t for p, t in docs if is_heldout(p)]
    held_paths = [p for p, _ in docs if is_heldout(p)]
    train_bytes = sum(len(t.encode()) for t in train_docs)
    held_bytes = sum(len(t.encode()) for t in held_docs)
    log(f"stdlib {stdlib}: {len(train_docs)} train files ({train_bytes / 1e6:.1f} MB), "
        f"{len(held_docs)} held-out files ({held_bytes / 1e6:.2f} MB)")

    # --- tokenizer
    tok = Tokenizer.from_file(str(args.draft_of / "tokenizer.json")) if args.draft_of else train_tokenizer(train_docs, VOCAB_SIZE)
    vocab = tok.get_vocab_size()
    train_stream = token_stream(tok, train_docs)
    held_stream = token_stream(tok, held_docs)
    log(f"tokenizer: vocab {vocab}; train {len(train_stream):,} tokens "
        f"({train_bytes / len(train_stream):.2f} bytes/token), held-out {len(held_stream):,} tokens")

    sample = heldout_sample(held_docs, HELDOUT_SAMPLE_BYTES)
    sample_ids = torch.tensor(tok.encode(sample, add_special_tokens=False).ids, dtype=torch.long)

    # --- model
    from preload.checkpoint.config import ModelConfig
    from preload.worker.model.deepseek import Transformer

    config = draft_config(vocab) if args.draft_of else model_config(vocab)
    cfg = ModelConfig.from_dict(config)
    weights = init_weights(cfg, seed=args.seed)
    saved = checkpoint_names(list(weights), config["num_hidden_layers"])
    n_params = sum(weights[n].numel() for n in saved)
    n_mtp = sum(weights[n].numel() for n in saved if n.startswith(f"model.layers.{config['num_hidden_layers']}."))
    # bf16 = 2 bytes a parameter; leave room for the safetensors header.
    assert 2 * n_params < SIZE_LIMIT_BYTES - 100_000, f"{n_params:,} parameters do not fit 10 MB in bf16"
    log(f"model: {n_params:,} parameters saved ({n_mtp:,} in the MTP layer), "
        f"{2 * n_params / 1e6:.2f} MB in bf16")

    # The router's e_score_correction_bias is DeepSeek's aux-loss-free balancing term,
    # not a gradient-trained parameter: keep it out of the optimizer; ExpertLoads moves it.
    bias_names = [n for n in weights if n.endswith("e_score_correction_bias")]
    trainable = {n: w for n, w in weights.items() if n not in bias_names}
    for w in trainable.values():
        w.requires_grad_(True)
    model = Transformer(cfg, weights)
    loads = ExpertLoads(model, cfg.n_routed_experts)

    decay = [w for n, w in trainable.items() if w.dim() >= 2]
    no_decay = [w for n, w in trainable.items() if w.dim() < 2]  # norms: no weight decay
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
    )
    gen = torch.Generator().manual_seed(args.seed)

    # --- plan: measure a forward+backward (no optimizer step, so weights are untouched)
    budget_s = args.minutes * 60
    probe = sample_batch(train_stream, args.batch, torch.Generator().manual_seed(12345))
    times = []
    for _ in range(3):
        t0 = time.time()
        main_loss, mtp_loss = losses(model, probe)
        (main_loss + MTP_LOSS_WEIGHT * mtp_loss if mtp_loss is not None else main_loss).backward()
        times.append(time.time() - t0)
    opt.zero_grad(set_to_none=True)
    step_s = min(times[1:]) * 1.05  # first call pays one-off allocation costs
    steps = args.steps if args.steps is not None else max(1, int(budget_s / step_s))
    warmup = max(1, min(100, steps // 20))
    log(f"step ~{step_s:.2f}s (batch {args.batch}x{SEQ_LEN}); planned {steps} steps, warmup {warmup}; "
        f"initial loss {main_loss.item():.3f} (ln V = {math.log(vocab):.3f})")

    # --- train
    t_train = time.time()
    step = 0
    for step in range(steps):
        if time.time() - t_train > budget_s:
            log(f"time budget reached after {step} of {steps} steps")
            break
        lr = lr_at(step, steps, args.lr, warmup)
        for group in opt.param_groups:
            group["lr"] = lr
        tokens = sample_batch(train_stream, args.batch, gen)
        loads.reset()
        main_loss, mtp_loss = losses(model, tokens)
        loss = main_loss + MTP_LOSS_WEIGHT * mtp_loss if mtp_loss is not None else main_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(list(trainable.values()), 1.0)
        opt.step()
        loads.update_bias(BIAS_UPDATE_SPEED)
        if step % 20 == 0 or step == steps - 1:
            log(f"step {step:4d}/{steps} lr {lr:.2e} loss {main_loss.item():.3f} "
                f"mtp {mtp_loss.item() if mtp_loss is not None else float('nan'):.3f} gnorm {gnorm:.2f} "
                f"max/mean expert load {loads.imbalance():.2f}")
    else:
        step = steps
    trained_steps = step
    final_imbalance = loads.imbalance()
    train_s = time.time() - t_train

    # --- evaluate (in fp32 training precision and again after the bf16 round trip the
    # checkpoint applies, which is what loaders will see)
    with torch.no_grad():
        for w in weights.values():
            w.requires_grad_(False)
            w.copy_(w.to(torch.bfloat16).float())
    windows = eval_windows(held_stream, EVAL_WINDOWS)
    held_loss, held_mtp = evaluate(model, windows, args.batch)
    sample_windows = eval_windows(sample_ids, len(sample_ids) // SEQ_LEN)
    sample_loss, _ = evaluate(model, sample_windows, args.batch)
    held_mtp = math.nan if held_mtp is None else held_mtp  # (a draft has no MTP layer)
    log(f"held-out ({len(windows)}x{SEQ_LEN} tokens): loss {held_loss:.4f} ppl {math.exp(held_loss):.2f}, "
        f"MTP loss {held_mtp:.4f} ppl {math.exp(held_mtp):.2f}; heldout.txt ({len(sample_windows)}x{SEQ_LEN}): "
        f"loss {sample_loss:.4f} ppl {math.exp(sample_loss):.2f}; uniform ppl {vocab}")

    # --- write
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    tensors = {n: weights[n].detach().to(torch.bfloat16).contiguous() for n in saved}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(config["max_position_embeddings"]), indent=2) + "\n")
    if not args.draft_of:  # (a draft is measured on the bundled model's sample)
        args.heldout_txt.parent.mkdir(parents=True, exist_ok=True)
        args.heldout_txt.write_text(sample, encoding="utf-8")

    wall_s = time.time() - t_start
    cpu_s = time.process_time()
    files = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    sizes = {f: (out / f).stat().st_size for f in files}
    command = "python scripts/train_tiny.py " + " ".join(sys.argv[1:])
    title = (f"{out.name}: a draft model for {args.draft_of.name} (speculative decoding; its tokenizer)"
             if args.draft_of else f"{out.name}: the bundled model")
    draft_note = (f"\nA draft model (`--draft-of {args.draft_of}`): {args.draft_of.name}'s tokenizer, read, not trained;"
                  f" one dense layer, hidden {config['hidden_size']}, no MoE and no MTP layer (`config.json`). The"
                  " paragraphs below are the recipe both share; what they say of experts, routing and the MTP layer"
                  " does not apply to it.\n" if args.draft_of else "")
    readme = README_TEMPLATE.format(
        title=title,
        draft_note=draft_note,
        command=command.strip(),
        seed=args.seed,
        python=sys.version.split()[0],
        torch=torch.__version__,
        stdlib=stdlib,
        n_train=len(train_docs), train_mb=train_bytes / 1e6, train_tokens=len(train_stream),
        n_held=len(held_docs), held_mb=held_bytes / 1e6, held_tokens=len(held_stream),
        held_files=", ".join(held_paths),
        vocab=vocab, vocab_ln=math.log(vocab), bpt=train_bytes / len(train_stream),
        n_params=n_params, n_mtp=n_mtp,
        steps=trained_steps, planned=steps, batch=args.batch, seq=SEQ_LEN, lr=args.lr, warmup=warmup,
        tokens_seen=trained_steps * args.batch * SEQ_LEN,
        step_s=train_s / max(1, trained_steps), train_min=train_s / 60, wall_min=wall_s / 60,
        cpu_min=cpu_s / 60, load=" / ".join(f"{x:.1f}" for x in os.getloadavg()),
        sizes="\n".join(f"| `{f}` | {s:,} |" for f, s in sizes.items()),
        total=sum(sizes.values()),
        n_windows=len(windows), held_loss=held_loss, held_ppl=math.exp(held_loss),
        mtp_row="" if math.isnan(held_mtp) else
        f"| held-out, MTP head (token after next) | {held_mtp:.4f} | {math.exp(held_mtp):.2f} |\n",
        sample_bytes=len(sample.encode()), sample_tokens=len(sample_ids), n_sample_windows=len(sample_windows),
        sample_loss=sample_loss, sample_ppl=math.exp(sample_loss),
        bias_speed=BIAS_UPDATE_SPEED, imbalance=final_imbalance,
    )
    (out / "README.md").write_text(readme)
    assert sum(sizes.values()) + len(readme) < SIZE_LIMIT_BYTES
    log(f"wrote {out} ({sum(sizes.values()):,} bytes){'' if args.draft_of else f' and {args.heldout_txt}'}; wall {wall_s / 60:.1f} min, "
        f"CPU {cpu_s / 60:.1f} min")


if __name__ == "__main__":
    main()
