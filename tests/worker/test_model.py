"""Our DeepSeek V2/V3 model agrees with transformers on random tiny checkpoints."""

import json

import pytest
import torch
from checkpoints import CASES, VOCAB, make_hf_model, save_hf_model
from safetensors.torch import load_file, save_file

from preload import LLM
from preload.kernels.fp8 import dequantize_block, quantize_block

PROMPT_LENGTHS = (23, 7, 40)


def random_prompts(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def oracle_logprobs(hf_model, prompt: list[int]) -> torch.Tensor:
    """transformers' log p(prompt[i] | prompt[:i]) for i >= 1."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0].float()
    return logits.log_softmax(-1)[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    arch, overrides = CASES[request.param]
    hf = make_hf_model(arch, seed=len(request.param), **overrides)
    path = save_hf_model(hf, tmp_path_factory.mktemp(request.param))
    return hf, LLM(path, dtype="float32")


def test_prompt_logprobs_match_transformers(case):
    hf, llm = case
    prompts = random_prompts(1)
    # All prompts in one batch: padding and per-sequence masks must not leak.
    results = llm.generate(prompts, max_tokens=1, prompt_logprobs=True)
    for prompt, result in zip(prompts, results):
        assert result.prompt_logprobs[0] is None
        ours = torch.tensor(result.prompt_logprobs[1:])
        assert len(ours) == len(prompt) - 1
        assert (ours - oracle_logprobs(hf, prompt)).abs().max() <= 1e-4


def test_greedy_continuation_matches_transformers(case):
    hf, llm = case
    prompts = random_prompts(2)
    eos = set(llm.stop_ids)
    for prompt, result in zip(prompts, llm.generate(prompts, max_tokens=16)):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt):].tolist()
        cut = next((i + 1 for i, t in enumerate(out) if t in eos), len(out))
        assert result.token_ids == out[:cut]


def test_decode_with_latent_cache_matches_full_forward(case):
    _, llm = case
    prompts = random_prompts(3)
    generated = llm.generate(prompts, max_tokens=16, logprobs=True)
    # Re-score prompt + continuation in one prefill: the decode steps (absorbed MLA over
    # the latent cache) must give the same log-probs as the expanded full forward.
    full = llm.generate([p + g.token_ids for p, g in zip(prompts, generated)], max_tokens=1, prompt_logprobs=True)
    for prompt, gen, ref in zip(prompts, generated, full):
        n = len(gen.token_ids)
        assert n > 0
        rescored = torch.tensor(ref.prompt_logprobs[len(prompt) : len(prompt) + n])
        assert (torch.tensor(gen.logprobs) - rescored).abs().max() <= 1e-5


def test_batched_greedy_equals_one_at_a_time(case):
    _, llm = case
    prompts = random_prompts(4)
    together = [r.token_ids for r in llm.generate(prompts, max_tokens=8)]
    alone = [llm.generate([p], max_tokens=8)[0].token_ids for p in prompts]
    assert together == alone


def test_native_fp8_checkpoint_matches_dequantized_twin(tmp_path):
    """A DeepSeek-style FP8 checkpoint (e4m3 + weight_scale_inv blocks) loads and
    agrees with a checkpoint holding the same weights dequantized to float32."""
    arch, overrides = CASES["v3-qlora-yarn"]
    hf_dir = save_hf_model(make_hf_model(arch, **overrides), tmp_path / "hf")
    block = [32, 32]  # smaller than DeepSeek's 128 so that these tiny matrices have several blocks, some partial
    fp8, twin = {}, {}
    for name, w in load_file(hf_dir / "model.safetensors").items():
        if name.endswith("proj.weight"):
            q, scale_inv = quantize_block(w, tuple(block))
            fp8[name], fp8[name + "_scale_inv"] = q, scale_inv
            twin[name] = dequantize_block(q, scale_inv, tuple(block), torch.float32)
        else:
            fp8[name] = twin[name] = w
    config = json.loads((hf_dir / "config.json").read_text())
    for name, tensors, quant in (("fp8", fp8, True), ("twin", twin, False)):
        d = tmp_path / name
        save_hf_model(make_hf_model(arch, **overrides), d)  # config + tokenizer
        if quant:
            config_q = config | {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": block}}
            (d / "config.json").write_text(json.dumps(config_q))
        save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    assert any(t.dtype == torch.float8_e4m3fn for t in load_file(tmp_path / "fp8" / "model.safetensors").values())
    prompts = random_prompts(5)
    a = LLM(tmp_path / "fp8", dtype="float32").generate(prompts, max_tokens=8, prompt_logprobs=True)
    b = LLM(tmp_path / "twin", dtype="float32").generate(prompts, max_tokens=8, prompt_logprobs=True)
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        assert torch.allclose(torch.tensor(x.prompt_logprobs[1:]), torch.tensor(y.prompt_logprobs[1:]), atol=1e-6)
