"""The bundled tiny model has learned something, and transformers reads it as we do."""

import math
import re
from pathlib import Path

import pytest
import torch
from train_tiny import train_forward

from preload import BUNDLED_MODEL, LLM
from preload.checkpoint.config import ModelConfig
from preload.ipc.packed_weights import load_checkpoint
from preload.worker.model.deepseek import Transformer

HELDOUT = Path(__file__).parents[1] / "data" / "heldout.txt"
WINDOW = 256


@pytest.fixture(scope="module")
def llm():
    return LLM(BUNDLED_MODEL, dtype="float32")


@pytest.fixture(scope="module")
def windows(llm):
    ids = llm.tokenizer.encode(HELDOUT.read_text())
    return [ids[i : i + WINDOW] for i in range(0, len(ids) - WINDOW, len(ids) // 6)][:6]


def test_checkpoint_is_small_and_complete():
    files = {p.name: p.stat().st_size for p in Path(BUNDLED_MODEL).iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md"} <= set(files)
    assert sum(files.values()) <= 10_000_000
    cfg = ModelConfig.from_dir(BUNDLED_MODEL)
    assert cfg.arch == "v3" and cfg.num_mtp_layers == 1
    assert cfg.n_routed_experts >= 8 and cfg.num_experts_per_tok >= 2 and cfg.n_shared_experts >= 1
    assert cfg.first_k_dense_replace >= 1


def test_heldout_perplexity_far_below_uniform(llm, windows):
    nll = [-sum(r.prompt_logprobs[1:]) / (len(w) - 1) for w, r in zip(windows, llm.generate(windows, max_tokens=1, prompt_logprobs=True))]
    perplexity = math.exp(sum(nll) / len(nll))
    print(f"held-out perplexity {perplexity:.2f} (uniform guess: {llm.config.vocab_size})")
    assert perplexity < llm.config.vocab_size / 50


def test_mtp_layer_predicts_two_ahead(windows):
    cfg = ModelConfig.from_dir(BUNDLED_MODEL)
    model = Transformer(cfg, load_checkpoint(BUNDLED_MODEL, cfg, torch.float32))
    assert model.mtp is not None
    tokens = torch.tensor(windows[:2])
    with torch.no_grad():
        _, mtp_logits = train_forward(model, tokens)
    loss = torch.nn.functional.cross_entropy(mtp_logits[:, :-1].flatten(0, 1), tokens[:, 2:].flatten())
    print(f"MTP held-out perplexity {loss.exp():.2f}")
    assert loss.exp() < cfg.vocab_size / 20


def test_transformers_agrees_with_our_logprobs(llm, windows):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(BUNDLED_MODEL, dtype=torch.float32).eval()
    prompt = windows[0][:128]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].log_softmax(-1)[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    ours = torch.tensor(llm.generate([prompt], max_tokens=1, prompt_logprobs=True)[0].prompt_logprobs[1:])
    assert (ours - ref).abs().max() <= 1e-4


def test_greedy_text_is_plausible_python(llm):
    # A model that learned Python names a function after `def ` and opens its arguments.
    out = llm.generate(["import os\n\n\ndef "], max_tokens=24)[0]
    print(repr(out.text))
    assert re.match(r"[A-Za-z_]\w*\(", out.text)


def test_fp8_kv_cache_keeps_perplexity(llm, windows):
    from preload.options import EngineOptions

    fp8 = LLM(BUNDLED_MODEL, dtype="float32", engine=EngineOptions(kv_cache_dtype="fp8"))

    def perplexity(model):
        results = model.generate(windows, max_tokens=1, prompt_logprobs=True)
        return math.exp(-sum(sum(r.prompt_logprobs[1:]) for r in results) / sum(len(w) - 1 for w in windows))

    base, quant = perplexity(llm), perplexity(fp8)
    print(f"held-out perplexity: kv cache auto {base:.3f}, fp8 {quant:.3f}")
    assert quant <= base * 1.02
