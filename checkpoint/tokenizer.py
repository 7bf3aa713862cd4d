"""Text <-> token ids from a checkpoint's tokenizer.json and tokenizer_config.json."""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _token_text(value) -> str | None:
    # tokenizer_config.json writes special tokens as strings or as AddedToken dicts.
    return value.get("content") if isinstance(value, dict) else value


class Tokenizer:
    def __init__(self, tokenizer_json: str, config: dict):
        """From the text of tokenizer.json and the parsed tokenizer_config.json."""
        from tokenizers import Tokenizer as _HFTokenizer  # (here: the daemon needs this module's file names only)

        self.hf = _HFTokenizer.from_str(tokenizer_json)  # the tokenizers library's own (streaming decoders step it)
        self.files = {"tokenizer.json": tokenizer_json, "tokenizer_config.json": json.dumps(config)}  # (to pass on)
        self.chat_template: str | None = config.get("chat_template")
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.add_bos = bool(config.get("add_bos_token", False))
        self.bos_id = self.hf.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_id = self.hf.token_to_id(self.eos_token) if self.eos_token else None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"{path}: not found; the checkpoint needs a tokenizer.json")
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        return cls(path.read_text(), config)

    def made_of(self, files: dict[str, str]) -> bool:
        """Whether `files` (tokenizer.json's text, tokenizer_config.json's) are this one's."""
        config = json.loads(files.get("tokenizer_config.json") or "{}")
        return files.get("tokenizer.json") == self.files["tokenizer.json"] and config == json.loads(
            self.files["tokenizer_config.json"])

    @cached_property
    def special_ids(self) -> frozenset[int]:
        """Ids that `decode` leaves out (special tokens); computed once (every request's
        detokenizer reads them)."""
        return frozenset(i for i, t in self.hf.get_added_tokens_decoder().items() if t.special)

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; a chat template's output already holds its special tokens."""
        ids = self.hf.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """What one token reads as on its own (for log-prob listings)."""
        return self.hf.decode([token_id], skip_special_tokens=False)
