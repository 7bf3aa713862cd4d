"""A sequence's output text, a token at a time, exactly as `Tokenizer.decode` reads the whole.

The tokenizers library's DecodeStream does the work: each step decodes only the tokens
since its text last grew, and gives nothing while that text would end in U+FFFD (half
a character), so what it gives never changes later. What is left to us:

- Special tokens never reach it: `decode` drops them before its decoder runs, so the
  text is the same without them, and DecodeStream would otherwise keep them and decode
  them again at every step until text comes.
- The end. Tokens that have not produced text yet (half a character, ids the tokenizer
  does not know) are still held when the sequence finishes; `finish` gives what
  `decode` makes of them.
- Runs of bytes that never form a character. DecodeStream re-decodes every token since
  its text last grew at each step, so a run of n of them would cost O(n^2). Past
  PATIENCE tokens we feed it only when the run has doubled: O(n) in all.

The property tests check that the pieces add up to `decode` of the whole output for
the bundled model's byte-level BPE and the tests' word-level tokenizer.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from preload.checkpoint.tokenizer import Tokenizer

PATIENCE = 8  # tokens without text fed one by one; a character is at most 4 bytes


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True):
        """skip_special: special tokens are left out, as `Tokenizer.decode` leaves them."""
        self.tokenizer, self._skip = tokenizer, skip_special
        self._special = tokenizer.special_ids if skip_special else frozenset()
        self._hf = tokenizer.hf
        self._stream = DecodeStream(skip_special_tokens=skip_special)
        self._unfed: list[int] = []  # tokens not given to the stream yet (see PATIENCE)
        self._waiting = 0  # tokens since the text last grew
        self._chars = 0  # length of the text given so far

    def add(self, token: int) -> str:
        """Take the next token; return the text it completes (often all of it, maybe '')."""
        if token in self._special:
            return ""
        self._unfed.append(token)
        self._waiting += 1
        if self._waiting > PATIENCE and self._waiting & (self._waiting - 1):
            return ""  # a long run without text: wait until it doubles
        new = self._stream.step(self._hf, self._unfed)
        self._unfed = []
        if new is None:
            return ""
        self._waiting = 0
        self._chars += len(new)
        return new

    def finish(self, output: list[int]) -> str:
        """After the last token of `output` (every token given to `add`): the rest of the text."""
        if not self._waiting:
            return ""
        # Rare (a sequence that ends mid-character), and once per sequence.
        return self.tokenizer.decode(output, self._skip)[self._chars :]
