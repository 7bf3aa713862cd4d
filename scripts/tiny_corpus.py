"""The bundled tiny model's corpus and tokenizer (scripts/train_tiny.py): the Python
standard library's own `.py` files, a deterministic held-out split by path, and a
byte-level BPE trained on the train split, with the special tokens and chat template the
checkpoint's tokenizer_config.json records."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# Special tokens; the order fixes their ids (bos = 0, eos = 1), which config.json records.
BOS, EOS = "<|begin|>", "<|end|>"
SPECIAL_TOKENS = [BOS, EOS, "<|user|>", "<|assistant|>", "<|system|>"]
MAX_FILE_BYTES = 200_000
HELDOUT_PER_MILLE = 20  # ~2% of files held out
HELDOUT_SAMPLE_BYTES = 24_000  # written to tests/data/heldout.txt
# Test suites, the IDE, third-party packages, and the codec tables of encodings/ (a hundred
# near-identical hex mapping tables that would skew both the tokenizer and the loss).
SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "encodings"}

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}<|system|>"
    "{% elif message['role'] == 'user' %}<|user|>"
    "{% else %}<|assistant|>{% endif %}"
    "{{ message['content'] }}<|end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


# ----------------------------------------------------------------------------- data


def collect_sources(stdlib: Path) -> list[tuple[str, str]]:
    """Return ``(relative path, text)`` of the stdlib's own ``.py`` files, sorted by path."""
    docs = []
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib)
        if SKIP_DIRS & set(rel.parts[:-1]) or path.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a handful of files use other encodings; not worth special-casing
        if text.strip():
            docs.append((rel.as_posix(), text))
    return docs


def is_heldout(rel_path: str) -> bool:
    """Deterministic split by path hash: same files held out on every machine and run."""
    digest = hashlib.sha256(rel_path.encode()).digest()
    return int.from_bytes(digest[:8], "big") % 1000 < HELDOUT_PER_MILLE


def heldout_sample(docs: list[str], n_bytes: int) -> str:
    """The first ~n_bytes of the held-out documents, cut at a line boundary."""
    text = "\n\n".join(docs)
    cut = text.encode("utf-8")[:n_bytes].decode("utf-8", errors="ignore")
    return cut[: cut.rfind("\n") + 1]


# ------------------------------------------------------------------------ tokenizer


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE (GPT-2 style), trained on the train split only.

    No post-processor: encoding stays plain and the engine adds bos itself.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        # All 256 bytes up front, so any text (not just what the stdlib contains) encodes.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    return tok


def token_stream(tok: Tokenizer, texts: list[str]) -> torch.Tensor:
    """Documents as ``<|begin|> doc <|end|>`` back to back, as one flat int64 tensor.

    Each document starts with bos too, so a model fed a bos-prefixed prompt (as the
    engine does when config says so) sees a context it was trained on.
    """
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.append(bos)
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def tokenizer_config(max_len: int) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "unk_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": max_len,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
