"""What each weight is stored as, known from its name and shape alone (no torch here: the
daemon plans a load it can do without importing torch, preloadd/copy_loader.py)."""

# Routing decisions are sensitive to rounding: the router and its bias stay in float32.
FLOAT32_SUFFIXES = ("mlp.gate.weight", "e_score_correction_bias")
QUANT_BLOCK = (128, 128)  # DeepSeek's fp8 block: one scale per 128 x 128 weights
SCALE_SUFFIX = "_scale_inv"
FP8 = "float8_e4m3fn"


def stored_dtype(name: str, dtype: str) -> str:
    """The torch dtype name weight `name` is kept in, unquantized, in a model of `dtype`."""
    return "float32" if name.endswith(FLOAT32_SUFFIXES) else dtype


def is_quantizable(name: str) -> bool:
    """The projection matrices of attention, dense MLPs and experts; not the MTP's
    eh_proj, which DeepSeek keeps in bf16 like the embeddings and heads."""
    return name.endswith("proj.weight") and not name.endswith("eh_proj.weight")


def stored_specs(name: str, shape: tuple[int, ...], mode: str, dtype: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{stored name: (torch dtype name, shape)} of checkpoint tensor `name` under quant
    `mode` in a model of `dtype`: itself, or e4m3 values and float32 scale_inv per block
    (fp8_block) or for the whole matrix (fp8_per_tensor). The arena is laid out from these."""
    if mode == "none" or not is_quantizable(name):
        return {name: (stored_dtype(name, dtype), shape)}
    block = QUANT_BLOCK if mode == "fp8_block" else shape
    scales = tuple(-(-n // b) for n, b in zip(shape, block))
    return {name: (FP8, shape), name + SCALE_SUFFIX: ("float32", scales)}
