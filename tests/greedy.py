"""Comparing greedy outputs of two GPU runs whose sums are ordered differently (a graph's
padded batch, another attention split, a verify pass of several tokens): the tokens are
the same except where the two candidates were a near tie."""

NEAR_TIE = 0.05  # log-prob gap under which two summation orders may pick either token
# A sequence preempted and recomputed, or verified several tokens at a time, gets its
# logits from a prefill instead of one-token steps: they may differ by a bf16 ulp of a
# logit, 0.125 for logits of 16 to 32.
ONE_ULP = 0.13


def assert_same_greedy(got, want, near: float = NEAR_TIE, most: bool = True) -> None:
    """Identical greedy tokens, except that at the first difference of a sequence the two
    candidates were a near tie in `want` (run with logprobs); past that the contexts
    differ and nothing more is compared. Most sequences must not differ at all (unless
    not `most`: outputs of repeated-token prompts are full of near ties)."""
    diverged = 0
    for g, w in zip(got, want):
        for step, (a, b) in enumerate(zip(g.token_ids, w.token_ids)):
            if a != b:
                top = w.top_logprobs[step]
                assert a in top and top[b] - top[a] < near, (step, a, b, top)
                diverged += 1
                break
    assert diverged <= (max(1, len(got) // 2) if most else len(got))
