"""Which weights keep float32 whatever the model's dtype (no torch here: the daemon
plans a load that needs no arithmetic without importing it)."""

# Routing decisions are sensitive to rounding: the router and its bias stay in float32.
FLOAT32_SUFFIXES = ("mlp.gate.weight", "e_score_correction_bias")


def stored_dtype(name: str, dtype: str) -> str:
    """The torch dtype name weight `name` is kept in, unquantized, in a model of `dtype`."""
    return "float32" if name.endswith(FLOAT32_SUFFIXES) else dtype
