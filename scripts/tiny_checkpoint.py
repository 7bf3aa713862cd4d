"""What the bundled tiny checkpoints are (scripts/train_tiny.py): the model's and the
draft's configs, the tensor names written, and the README beside them."""

from __future__ import annotations


# ---------------------------------------------------------------------------- model


def model_config(vocab_size: int) -> dict:
    """A DeepSeek-V3-shaped config scaled down to ~4.5M parameters (bf16 < 10 MB)."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": vocab_size,
        "hidden_size": 256,
        "intermediate_size": 512,  # the dense layer(s)
        "moe_intermediate_size": 128,  # each routed and shared expert
        "num_hidden_layers": 3,
        "first_k_dense_replace": 1,  # layer 0 dense, the rest MoE
        "moe_layer_freq": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 96,
        "kv_lora_rank": 64,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "head_dim": 16,  # HF's name for qk_rope_head_dim in DeepSeek configs
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "n_group": 4,  # 4 groups of 2 experts, keep the best 2 groups: routing is really group-limited
        "topk_group": 2,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "num_nextn_predict_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "max_position_embeddings": 4096,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 1,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
    }


def draft_config(vocab_size: int) -> dict:
    """A draft model for speculative decoding beside the bundled one (same vocabulary):
    one dense layer at half the width, no MTP layer; about a fifth of its parameters."""
    return model_config(vocab_size) | {
        "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 1, "first_k_dense_replace": 1,
        "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 64, "kv_lora_rank": 32,
        "num_nextn_predict_layers": 0,
    }


def checkpoint_names(names: list[str], n_layers: int) -> list[str]:
    """Drop the MTP layer's own embedding / head copies: loaders share the main model's."""
    mtp = f"model.layers.{n_layers}."
    skip = (mtp + "embed_tokens.weight", mtp + "shared_head.head.weight")
    return [n for n in names if n not in skip]


README_TEMPLATE = """\
# {title}
{draft_note}
A ~{n_params:,}-parameter `DeepseekV3ForCausalLM` trained from scratch on the Python
standard library's own source, so demos and tests have a model that has learned
something (random weights cannot test quantization quality or speculative decoding).
It writes plausible-looking Python; it is not useful for anything else, and it has
never seen a chat (the chat template exists so the chat code paths have one to use).

## How it was made

```
{command}
```

- seed {seed}; Python {python}, torch {torch}, CPU only, 2 threads
- wall time {wall_min:.1f} min in all ({train_min:.1f} min in the training loop,
  {step_s:.2f} s a step); CPU time {cpu_min:.1f} min (both threads together); load
  average at the end {load} (1 / 5 / 15 min; above 2 means other work shared the cores)

**Data.** Every `.py` file of the stdlib at `{stdlib}` except test suites (`test/`,
`tests/`), `idlelib/`, `site-packages/`, the codec tables of `encodings/` and files over
200 KB, sorted by path. A file is
held out when the SHA-256 of its relative path, first 8 bytes mod 1000, is below 20 (~2%).
Train: {n_train} files, {train_mb:.1f} MB, {train_tokens:,} tokens. Held out: {n_held}
files, {held_mb:.2f} MB, {held_tokens:,} tokens ({held_files}).
Documents are tokenized and concatenated as `<|begin|> doc <|end|>` back to back; each
training sequence is a random {seq}-token window of that stream.

**Tokenizer.** Byte-level BPE (`tokenizers`, ByteLevel pre-tokenizer and decoder, all 256
bytes in the base alphabet), vocabulary {vocab}, trained on the train split only,
{bpt:.2f} bytes a token. Special tokens `<|begin|>` (0, bos), `<|end|>` (1, eos),
`<|user|>`, `<|assistant|>`, `<|system|>`. Encoding adds no special tokens (no
post-processor); the engine adds bos itself.

**Model.** See `config.json`: hidden 256, 3 layers (layer 0 dense SwiGLU 512, layers 1-2
MoE), MLA (4 heads, q_lora_rank 96, kv_lora_rank 64, nope 32 + rope 16, v 32), 8 routed
experts of 128 in 4 groups (top-2 groups, top-2 experts, sigmoid scores, noaux_tc,
normalized, scaled by 2.5) plus 1 shared expert, untied head, one MTP layer (layer 3:
enorm, hnorm, eh_proj, an MoE decoder block, shared_head.norm; it shares the main
model's embedding and lm_head, which are therefore not stored twice).
{n_params:,} parameters are stored, {n_mtp:,} of them in the MTP layer.

**Training.** As DeepSeek-V3 does: loss = CE(next token) + 0.3 * CE(MTP, token after
next). AdamW (betas 0.9/0.95, weight decay 0.1 on matrices), peak lr {lr:g}, {warmup}
warmup steps then cosine decay to 10% over {planned} planned steps; gradient clipping
1.0; batch {batch} x {seq} tokens; fp32. {steps} steps ran ({tokens_seen:,} tokens).
The router's `e_score_correction_bias` is not trained by gradient: after each step,
DeepSeek-V3's aux-loss-free balancing moves it by {bias_speed:g} * sign(mean load - expert load),
loads counted over the step's tokens in each MoE layer (the MTP layer's included).
Final max/mean expert load over the MoE layers, on the last batch: {imbalance:.2f}.

## Results

Held-out loss is the mean next-token cross-entropy (nats) over {n_windows} fixed,
non-overlapping {seq}-token windows spread evenly over the held-out stream, measured
after rounding the weights to bf16 as stored.

| | loss | perplexity |
|---|---|---|
| held-out, main head | {held_loss:.4f} | {held_ppl:.2f} |
{mtp_row}| `tests/data/heldout.txt`, main head | {sample_loss:.4f} | {sample_ppl:.2f} |
| uniform guess | {vocab_ln:.4f} | {vocab} |

`tests/data/heldout.txt` is the first ~24 KB of the held-out files (joined by a blank
line, cut at a line end): {sample_bytes:,} bytes, {sample_tokens:,} tokens; its loss is
measured over its {n_sample_windows} non-overlapping {seq}-token windows (no bos), so tests
do not depend on the local stdlib.

| file | bytes |
|---|---|
{sizes}

Total {total:,} bytes.
"""

