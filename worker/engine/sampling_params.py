"""What a request asks of generation, and the one place where its ranges are checked.

Every caller (the HTTP API, `LLM.generate`) builds a SamplingParams, so a value out of
range is refused here, once, naming the parameter, before anything reaches the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

# Temperatures below this mean greedy, as in vLLM: dividing logits by 1e-45 gives inf,
# and the softmax of inf is NaN.
GREEDY_BELOW = 1e-5

MAX_LOGPROBS = 20  # OpenAI's limit on top log-probs per token


class RequestError(ValueError):
    """A request the engine cannot serve as asked; `param` names the field at fault."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # below GREEDY_BELOW: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means all tokens
    min_p: float = 0.0  # tokens less likely than min_p times the most likely one are never drawn
    seed: int | None = None
    logprobs: int | None = None  # None: none; 0: the chosen token's; n: also the n most likely
    prompt_logprobs: int | None = None  # None: none; 0: each prompt token's log-prob; n: also the n most likely
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False  # the stop string (or stop token's text) ends the text, not cut off
    skip_special_tokens: bool = True  # special tokens are left out of the text
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # > 1 discourages every token already in the prompt or output
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    min_tokens: int = 0  # the stop tokens (EOS, stop_token_ids) are banned until this many are out
    grammar: str | None = None  # structured output: an llguidance grammar the output must follow (grammar.py)
    cache_salt: str | None = None  # prefix-cache blocks are shared only between requests of one salt

    def __post_init__(self):
        # Each test says what is allowed, so NaN (which fails every comparison) is refused too.
        ranges = [
            ("max_tokens", self.max_tokens >= 1, "must be >= 1"),
            ("temperature", 0.0 <= self.temperature <= 2.0, "must be in [0, 2]"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", self.top_k >= 0, "must be >= 0"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("seed", self.seed is None or -(2**63) <= self.seed < 2**64, "must be in [-2^63, 2^64)"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, f"must be in [0, {MAX_LOGPROBS}]"),
            ("prompt_logprobs", self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
             f"must be in [0, {MAX_LOGPROBS}]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]"),
            ("repetition_penalty", 0.0 < self.repetition_penalty <= 2.0, "must be in (0, 2]"),
            ("logit_bias", all(-100.0 <= b <= 100.0 for _, b in self.logit_bias), "values must be in [-100, 100]"),
            ("min_tokens", 0 <= self.min_tokens <= self.max_tokens, "must be in [0, max_tokens]"),
            ("cache_salt", self.cache_salt is None or 0 < len(self.cache_salt) <= 1024, "must be 1 to 1024 characters"),
        ]
        for param, ok, rule in ranges:
            if not ok:
                raise RequestError(f"{param} {rule}, got {getattr(self, param)!r}", param)

    @property
    def steers(self) -> bool:
        """Whether the logits are changed before sampling beyond the penalties (see sampler.steer)."""
        return bool(self.logit_bias) or self.repetition_penalty != 1.0 or self.min_tokens > 0 or self.grammar is not None

    @property
    def shapes_logits(self) -> bool:
        """Whether anything but temperature, top-k and top-p changes the logits before a draw:
        steering or the OpenAI penalties (most of which read the tokens generated so far)."""
        return self.steers or bool(self.presence_penalty) or bool(self.frequency_penalty)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def draw_seed(seed: int, index: int) -> int:
    """The seed a seeded request's draw for its output token `index` starts from (SplitMix64
    of the two): a function of the request and the position alone, so that the request
    computed again elsewhere (resumed after its worker died, or preempted) draws the same
    tokens, whatever else its process drew before."""
    x = (seed + 0x9E3779B97F4A7C15 * (index + 1)) % 2**64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % 2**64
    return x ^ (x >> 31)
