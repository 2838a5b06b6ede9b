"""A character-level tokenizer for the synthetic tasks, in the Hugging Face format, and its loader.

Every printable ASCII character plus tab and newline is one token, so every task and dataset string
round-trips exactly; `load_tokenizer` returns a `transformers` tokenizer, the same interface a real
model's (e.g. Qwen's) has, so one drops in for the other.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models
from transformers import AutoTokenizer, PreTrainedTokenizerFast

# Special tokens, in id order: <pad> is 0 so zero-initialised buffers are padding.
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
# Ordinary tokens: tab, newline and printable ASCII (space .. "~"), ids 4..100.
CHARACTERS = ("\t", "\n") + tuple(chr(c) for c in range(32, 127))
# Padded with <reserved_k> special tokens to a multiple of 128 (lane- and MXU-friendly on TPU).
VOCAB_SIZE = 128
RESERVED_TOKENS = tuple(f"<reserved_{k}>" for k in range(VOCAB_SIZE - len(SPECIAL_TOKENS) - len(CHARACTERS)))

# The shipped tokenizer directory (tokenizer.json, tokenizer_config.json, special_tokens_map.json).
TOKENIZER_DIR = Path(__file__).resolve().parent / "data" / "tokenizer"

_SPECIAL_TOKEN_KWARGS = {
    "pad_token": "<pad>",
    "bos_token": "<bos>",
    "eos_token": "<eos>",
    "unk_token": "<unk>",
}


def build_char_tokenizer() -> Tokenizer:
    """Builds the character-level `tokenizers.Tokenizer` (deterministic: same object every call).

    A BPE model with no merges splits text into single characters; characters outside the vocabulary
    become <unk>. The `Fuse` decoder concatenates tokens with nothing in between (the default joins
    them with spaces), which is what makes `decode(encode(s)) == s`. No BOS/EOS is added on encode,
    as with Qwen's tokenizer: callers add `bos_token_id` / `eos_token_id` themselves where wanted.
    """
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS + RESERVED_TOKENS)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS + RESERVED_TOKENS]
    )
    return tokenizer


def tokenizer_config() -> dict:
    """The tokenizer_config.json contents, so `AutoTokenizer.from_pretrained(dir)` loads the dir."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **_SPECIAL_TOKEN_KWARGS,
        # transformers' clean-up would turn "a ." into "a." and break exact round trips.
        "clean_up_tokenization_spaces": False,
    }


def write_tokenizer_files(directory: str | os.PathLike) -> list[Path]:
    """Writes tokenizer.json, tokenizer_config.json and special_tokens_map.json into `directory`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer_json = json.loads(build_char_tokenizer().to_str())
    files = {
        "tokenizer.json": tokenizer_json,
        "tokenizer_config.json": tokenizer_config(),
        "special_tokens_map.json": dict(_SPECIAL_TOKEN_KWARGS),
    }
    paths = []
    for name, content in files.items():
        path = directory / name
        path.write_text(json.dumps(content, indent=2, ensure_ascii=True) + "\n", encoding="utf-8")
        paths.append(path)
    return paths


def load_tokenizer(path: str | os.PathLike | None = None):
    """Returns a `transformers` fast tokenizer.

    path: None for the shipped character tokenizer; a tokenizer.json file (special tokens are taken
    from a tokenizer_config.json beside it, if any); or a directory / Hub name, loaded with
    `AutoTokenizer.from_pretrained` (e.g. a local Qwen checkpoint directory).
    """
    if path is None:
        path = TOKENIZER_DIR / "tokenizer.json"
    path = Path(path)
    if not path.is_file():
        return AutoTokenizer.from_pretrained(str(path))
    kwargs = {"clean_up_tokenization_spaces": False}
    config_path = path.parent / "tokenizer_config.json"
    if config_path.is_file():
        config = json.loads(config_path.read_text(encoding="utf-8"))
        kwargs.update({k: config[k] for k in _SPECIAL_TOKEN_KWARGS if isinstance(config.get(k), str)})
        kwargs["clean_up_tokenization_spaces"] = config.get("clean_up_tokenization_spaces", False)
    return PreTrainedTokenizerFast(tokenizer_file=str(path), **kwargs)
