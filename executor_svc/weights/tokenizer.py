"""The model's tokenizer, rebuilt from GGUF metadata as a `tokenizers` fast tokenizer.

A GGUF carries no `tokenizer.json`: it stores the vocabulary, merges, scores and
token types under llama.cpp's key names (`tokenizer.ggml.*`). We rebuild the
pipeline those describe here, without transformers, so the executor can ship it
to the scheduler as one JSON string (`Tokenizer.to_str()` / `Tokenizer.from_str`).

Two vocabulary kinds are supported, named by `tokenizer.ggml.model`:

- "gpt2": byte-level BPE. Tokens are spelled in GPT-2's byte-to-unicode
  alphabet; the text is split by a regex chosen by `tokenizer.ggml.pre`
  (llama.cpp's name for the original tokenizer.json's pre-tokenizer).
- "llama": sentencepiece-style BPE over "▁"-escaped text with byte fallback
  (`<0x0A>` tokens), merges recovered from the scores when the file has none.

Token types (llama.cpp's `llama_token_type`): CONTROL tokens become special
added tokens (matched whole in the text, skipped by `skip_special_tokens`),
USER_DEFINED tokens become plain added tokens (matched whole, e.g. `<think>`).

Where transformers' GGUF loader and llama.cpp disagree on what the file means,
this follows llama.cpp (and the model's original tokenizer.json), except in two
places where it follows transformers: where a sentencepiece vocabulary puts its
space prefix, and how a file with no `tokenizer.ggml.pre` splits; each place says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gguf import TokenType
from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

from executor_svc.errors import ModelLoadError
from executor_svc.weights.gguf_file import GGUFFile

SUPPORTED_TOKENIZER_MODELS = ("gpt2", "llama")

SPM_SPACE = "\u2581"  # "▁": sentencepiece's visible space

# The regexes below are the original tokenizer.json ones (as transformers
# carries them); llama.cpp runs rewritten but equivalent forms of the same.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class ByteLevelSplit:
    """How a byte-level vocabulary's text is cut into words before BPE.

    `split_regex` None means GPT-2's own regex, which `ByteLevel(use_regex=True)` applies.
    """

    split_regex: str | None
    has_individual_digits: bool = False  # llama.cpp's extra "\p{N}" pass before the regex
    has_ignore_merges: bool = False  # a word that is itself a token is taken whole, unmerged
    has_bos_by_default: bool = False  # add BOS when the file has no add_bos_token flag

    def pre_tokenizer(self) -> pre_tokenizers.PreTokenizer:
        if self.split_regex is None:
            byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
            if not self.has_individual_digits:
                return byte_level
            return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(self.split_regex), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )


_GPT2 = ByteLevelSplit(None)
_DIGITS_THEN_GPT2 = ByteLevelSplit(None, has_individual_digits=True)
_LLAMA3 = ByteLevelSplit(LLAMA3_SPLIT, has_ignore_merges=True, has_bos_by_default=True)
_LLAMA3_REGEX_ONLY = ByteLevelSplit(LLAMA3_SPLIT)
_QWEN2 = ByteLevelSplit(QWEN2_SPLIT)
_QWEN35 = ByteLevelSplit(QWEN35_SPLIT)
_TEKKEN = ByteLevelSplit(TEKKEN_SPLIT, has_ignore_merges=True, has_bos_by_default=True)

# `tokenizer.ggml.pre` -> split, grouped as llama.cpp's llama-vocab.cpp groups them.
# A file without the key gets GPT-2's regex, as in transformers (llama.cpp's
# "default" instead runs a punctuation/3-digit pass first, with a warning).
BYTE_LEVEL_SPLITS: dict[str | None, ByteLevelSplit] = {
    None: _GPT2,
    "default": _GPT2,
    "gpt2": _GPT2,
    "gpt-2": _GPT2,
    "phi-2": _GPT2,
    "mpt": _GPT2,
    "olmo": _GPT2,
    "jais": _GPT2,
    "trillion": _GPT2,
    "granite-docling": _GPT2,
    # transformers ignores these names and uses GPT-2's regex alone; the
    # original tokenizer.json (and llama.cpp) isolate each digit first.
    "smollm": _DIGITS_THEN_GPT2,
    "starcoder": _DIGITS_THEN_GPT2,
    "refact": _DIGITS_THEN_GPT2,
    "command-r": _DIGITS_THEN_GPT2,
    "codeshell": _DIGITS_THEN_GPT2,
    "exaone": _DIGITS_THEN_GPT2,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "llama-bpe": _LLAMA3,
    "falcon3": _LLAMA3,
    "falcon-h1": _LLAMA3,
    "pixtral": _LLAMA3,
    "midm-2.0": _LLAMA3,
    "lfm2": _LLAMA3,
    "dbrx": _LLAMA3_REGEX_ONLY,
    "smaug-bpe": _LLAMA3_REGEX_ONLY,
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
    "megrez": _QWEN2,
    "stablelm2": _QWEN2,
    "qwen35": _QWEN35,
    "tekken": _TEKKEN,
}


@dataclass(frozen=True)
class TokenizerInfo:
    """The tokenizer plus what generation needs to know about its special tokens.

    `eos_token_ids` holds every id that ends a turn per the metadata: the EOS id
    and, when the file names one, the end-of-turn id (`<|eot_id|>`-style).
    """

    tokenizer: Tokenizer
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    add_bos_token: bool
    chat_template: str | None

    def __post_init__(self) -> None:
        vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        named = ([self.bos_token_id] if self.bos_token_id is not None else []) + list(self.eos_token_ids)
        for token_id in named:
            if not 0 <= token_id < vocab_size:
                raise ModelLoadError(f"special token id {token_id} is outside the vocabulary (size {vocab_size})")
        if self.add_bos_token and self.bos_token_id is None:
            raise ModelLoadError("tokenizer.ggml.add_bos_token is set but the file names no bos_token_id")

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.tokenizer.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        """The text of the primary EOS token (what chat templates call `eos_token`)."""
        return self.tokenizer.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else None

    def to_json(self) -> str:
        """The whole pipeline, for `Tokenizer.from_str` on the scheduler's side."""
        return self.tokenizer.to_str()


def load_tokenizer(gguf: GGUFFile) -> TokenizerInfo:
    """The tokenizer a GGUF file describes; raises ModelLoadError naming the file and problem."""
    try:
        return tokenizer_info_from_metadata(gguf.metadata)
    except ModelLoadError as exc:
        raise ModelLoadError(f"{gguf.path}: {exc}") from exc


def tokenizer_info_from_metadata(metadata: dict[str, Any]) -> TokenizerInfo:
    """`load_tokenizer` for metadata already in hand (no file path in the errors)."""
    tokenizer = build_tokenizer(metadata)
    bos_token_id = _optional_int(metadata, "tokenizer.ggml.bos_token_id")
    eos_token_ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        token_id = _optional_int(metadata, key)
        if token_id is not None and token_id not in eos_token_ids:
            eos_token_ids.append(token_id)
    chat_template = metadata.get("tokenizer.chat_template")
    return TokenizerInfo(
        tokenizer=tokenizer,
        bos_token_id=bos_token_id,
        eos_token_ids=tuple(eos_token_ids),
        add_bos_token=_add_bos_token(metadata),
        chat_template=str(chat_template) if chat_template is not None else None,
    )


def build_tokenizer(metadata: dict[str, Any]) -> Tokenizer:
    """A fast tokenizer built only from `tokenizer.ggml.*` metadata.

    `encode(text, add_special_tokens=True)` prepends BOS exactly when the file
    asks for it (and appends EOS when `add_eos_token` is set), as transformers does.
    """
    model = metadata.get("tokenizer.ggml.model")
    if model == "gpt2":
        tokenizer = _byte_level_bpe(metadata)
    elif model == "llama":
        tokenizer = _sentencepiece_bpe(metadata)
    else:
        found = "no tokenizer.ggml.model" if model is None else f"tokenizer type {model!r}"
        raise ModelLoadError(
            f"{found}: cannot build a tokenizer (supported tokenizer.ggml.model values: "
            f"{', '.join(SUPPORTED_TOKENIZER_MODELS)})"
        )
    tokenizer.post_processor = _post_processor(metadata, tokenizer)
    return tokenizer


def _byte_level_bpe(metadata: dict[str, Any]) -> Tokenizer:
    pre = metadata.get("tokenizer.ggml.pre")
    split = BYTE_LEVEL_SPLITS.get(pre)
    if split is None:
        known = ", ".join(sorted(name for name in BYTE_LEVEL_SPLITS if name is not None))
        raise ModelLoadError(f"pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported (supported: {known})")
    tokens = _tokens(metadata)
    token_types = _token_types(metadata, len(tokens))
    if "tokenizer.ggml.merges" not in metadata:
        raise ModelLoadError("a gpt2 (byte-level BPE) tokenizer needs tokenizer.ggml.merges, and the file has none")
    merges = _merges(metadata)

    # Ordinary tokens are already in GPT-2's byte alphabet; control and
    # user-defined ones keep their literal text, because they are matched
    # against the raw input before any byte mapping (llama.cpp does the same).
    # transformers instead respells every out-of-alphabet token and then skips
    # adding it, so e.g. "<｜end▁of▁sentence｜>" is no longer recognised there.
    alphabet = frozenset(pre_tokenizers.ByteLevel.alphabet())
    spell = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    literal_types = (TokenType.CONTROL, TokenType.UNKNOWN, TokenType.USER_DEFINED)
    spelled = [
        token
        if token_type in literal_types or set(token) <= alphabet
        else "".join(piece for piece, _ in spell.pre_tokenize_str(token))
        for token, token_type in zip(tokens, token_types)
    ]
    vocab = {token: token_id for token_id, token in enumerate(spelled)}
    tokenizer = Tokenizer(
        BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=split.has_ignore_merges,
        )
    )
    tokenizer.pre_tokenizer = split.pre_tokenizer()
    tokenizer.decoder = decoders.ByteLevel()
    _add_typed_tokens(tokenizer, spelled, token_types, vocab)
    return tokenizer


def _sentencepiece_bpe(metadata: dict[str, Any]) -> Tokenizer:
    """Sentencepiece BPE as transformers' LlamaTokenizer builds it.

    Spaces become "▁"; a "▁" is prepended to the text when `add_space_prefix`
    (default true) says so. The prefix goes only on the text's first piece, as
    transformers (legacy=False) does; llama.cpp also prepends one after every
    special token. transformers ignores `add_space_prefix = false`; we honour it.
    """
    tokens = _tokens(metadata)
    token_types = _token_types(metadata, len(tokens))
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    if "tokenizer.ggml.merges" in metadata:
        merges = _merges(metadata)
    else:
        scores = metadata.get("tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise ModelLoadError(
                "a llama (sentencepiece) tokenizer needs tokenizer.ggml.merges or one "
                "tokenizer.ggml.scores entry per token"
            )
        merges = merges_from_scores(vocab, dict(zip(tokens, (float(s) for s in scores))))
    unk_id = _optional_int(metadata, "tokenizer.ggml.unknown_token_id")
    add_space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))

    tokenizer = Tokenizer(
        BPE(
            vocab=vocab,
            merges=merges,
            unk_token=tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None,
            fuse_unk=True,
            byte_fallback=True,
            dropout=None,
        )
    )
    tokenizer.normalizer = None
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=SPM_SPACE, prepend_scheme="first" if add_space_prefix else "never", split=False
    )
    steps = [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tokenizer.decoder = decoders.Sequence(steps)
    _add_typed_tokens(tokenizer, tokens, token_types, vocab)
    return tokenizer


def merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges implied by a sentencepiece vocabulary, best first.

    Every token that splits into two tokens yields a merge ranked by the whole
    token's score: sentencepiece merges the highest-scoring pair first. Ties go
    to the longer left piece, then the longer right; within one token, pairs
    are ordered by their pieces' ids. This is transformers' `generate_merges`.
    """
    candidates: list[tuple[str, str, float]] = []
    for merged, score in scores.items():
        local = [
            (merged[:cut], merged[cut:], score)
            for cut in range(1, len(merged))
            if merged[:cut] in vocab and merged[cut:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        candidates.extend(local)
    candidates.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in candidates]


def _add_typed_tokens(tokenizer: Tokenizer, tokens: list[str], token_types: list[int], vocab: dict[str, int]) -> None:
    """CONTROL (and UNKNOWN) tokens as special added tokens, USER_DEFINED ones as plain ones.

    llama.cpp matches all three whole in the text; transformers adds `<unk>` as
    a special token too.

    Only a token that owns its text in `vocab` is added, so every added token
    keeps its file id and the vocabulary never grows past the model's rows.
    """
    control: list[AddedToken] = []
    user_defined: list[AddedToken] = []
    for token_id, (token, token_type) in enumerate(zip(tokens, token_types)):
        if vocab.get(token) != token_id:
            continue
        if token_type in (TokenType.CONTROL, TokenType.UNKNOWN):
            control.append(AddedToken(token, normalized=False, special=True))
        elif token_type == TokenType.USER_DEFINED:
            user_defined.append(AddedToken(token, normalized=False, special=False))
    if control:
        tokenizer.add_special_tokens(control)
    if user_defined:
        tokenizer.add_tokens(user_defined)


def _post_processor(metadata: dict[str, Any], tokenizer: Tokenizer) -> processors.TemplateProcessing | None:
    """BOS before (and EOS after) each sequence when the file asks for them."""
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    wanted: dict[str, str] = {}  # "bos"/"eos" -> token text
    special_tokens: list[tuple[str, int]] = []
    for name, is_wanted in (
        ("bos", _add_bos_token(metadata)),
        ("eos", bool(metadata.get("tokenizer.ggml.add_eos_token", False))),
    ):
        if not is_wanted:
            continue
        token_id = _optional_int(metadata, f"tokenizer.ggml.{name}_token_id")
        if token_id is None or not 0 <= token_id < vocab_size:
            raise ModelLoadError(
                f"tokenizer.ggml.add_{name}_token is set but tokenizer.ggml.{name}_token_id "
                f"is {'missing' if token_id is None else f'{token_id}, outside the vocabulary'}"
            )
        wanted[name] = tokenizer.id_to_token(token_id)
        special_tokens.append((wanted[name], token_id))
    if not wanted:
        return None
    bos = [wanted["bos"]] if "bos" in wanted else []
    eos = [wanted["eos"]] if "eos" in wanted else []
    return processors.TemplateProcessing(
        single=[*bos, "$A", *eos],
        pair=[*bos, "$A", *eos, *(f"{t}:1" for t in bos), "$B:1", *(f"{t}:1" for t in eos)],
        special_tokens=special_tokens,
    )


def _add_bos_token(metadata: dict[str, Any]) -> bool:
    """The file's flag; without one, what llama.cpp assumes for this vocabulary."""
    flag = metadata.get("tokenizer.ggml.add_bos_token")
    if flag is not None:
        return bool(flag)
    if metadata.get("tokenizer.ggml.model") == "llama":
        return True
    split = BYTE_LEVEL_SPLITS.get(metadata.get("tokenizer.ggml.pre"))
    return split is not None and split.has_bos_by_default


def _tokens(metadata: dict[str, Any]) -> list[str]:
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError("the file has no tokenizer.ggml.tokens vocabulary")
    return [str(token) for token in tokens]


def _token_types(metadata: dict[str, Any], num_tokens: int) -> list[int]:
    token_types = metadata.get("tokenizer.ggml.token_type")
    if token_types is None:
        return [int(TokenType.NORMAL)] * num_tokens
    if len(token_types) != num_tokens:
        raise ModelLoadError(f"tokenizer.ggml.token_type has {len(token_types)} entries for {num_tokens} tokens")
    return [int(t) for t in token_types]


def _merges(metadata: dict[str, Any]) -> list[tuple[str, str]]:
    merges: list[tuple[str, str]] = []
    for merge in metadata["tokenizer.ggml.merges"]:
        parts = str(merge).split(" ")
        if len(parts) != 2:
            raise ModelLoadError(f"tokenizer.ggml.merges entry {merge!r} is not two tokens separated by one space")
        merges.append((parts[0], parts[1]))
    return merges


def _optional_int(metadata: dict[str, Any], key: str) -> int | None:
    value = metadata.get(key)
    return None if value is None else int(value)
