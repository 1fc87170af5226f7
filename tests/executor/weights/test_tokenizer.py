"""The tokenizer rebuilt from GGUF metadata, and the chat template renderer.

The reference is transformers loading the same GGUF file. Where transformers'
GGUF loader is known to differ from llama.cpp (and from the model's original
tokenizer.json), the tests say so and compare against transformers' tokenizer
with the original pre-tokenizer put back instead.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers / huggingface_hub are imported
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from executor_svc.errors import ModelLoadError
from executor_svc.weights.gguf_file import open_gguf
from executor_svc.weights.model_source import resolve_model_path
from executor_svc.weights.tokenizer import (
    BYTE_LEVEL_SPLITS,
    TokenizerInfo,
    build_tokenizer,
    load_tokenizer,
    merges_from_scores,
)
from scheduler_svc.chat_template import (
    ChatTemplateError,
    InvalidMessagesError,
    compile_chat_template,
    render_chat_template,
)

SPM_SPACE = "\u2581"


def load_transformers_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def with_pre_tokenizer(hf_tokenizer: Any, pre_tokenizer: dict[str, Any]) -> Tokenizer:
    """transformers' backend tokenizer for the file, with another pre-tokenizer (as tokenizer.json spells it)."""
    spec = json.loads(hf_tokenizer.backend_tokenizer.to_str())
    spec["pre_tokenizer"] = pre_tokenizer
    return Tokenizer.from_str(json.dumps(spec))


def byte_level(use_regex: bool) -> dict[str, Any]:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": use_regex}


# SmolLM2's tokenizer.json pre-tokenizer; llama.cpp's "smollm" does the same
# (a "\p{N}" split, then GPT-2's regex). transformers' GGUF loader drops the
# digit split and runs GPT-2's regex alone.
DIGITS_THEN_GPT2_PRE = {
    "type": "Sequence",
    "pretokenizers": [{"type": "Digits", "individual_digits": True}, byte_level(use_regex=True)],
}


# --------------------------------------------------------------------------------------
# The embedded SmolLM2 model against transformers
# --------------------------------------------------------------------------------------

PYTHON_SOURCE = '''import os


class Greeter:
\t"""Says hello."""

\tdef __init__(self, name: str) -> None:
\t\tself.name = name

    def greet(self, excited=False):
        if excited:
            return f"Hello, {self.name}!"  # trailing spaces follow   
        return "hello " + self.name
'''  # noqa: W291 (the trailing spaces are the test's)

LONG_TEXT = (
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs! "
    "Sphinx of black quartz, judge my vow; how vexingly quick daft zebras jump. "
) * 40

# Texts on which transformers' GGUF tokenizer and the original tokenizer.json agree.
CORPUS = [
    "",
    "hello world",
    "Hello, World!",
    PYTHON_SOURCE,
    "multiple   internal    spaces",
    "  leading and trailing spaces  ",
    "line one\nline two\n\n\nline five\n",
    "windows\r\nline\r\nendings\r\n",
    "\t\ttabs\tand \t mixed \t\n",
    "   ",
    "\n",
    "1234567890",
    "3.14159 and 2.71828, 1,000,000 and 42",
    "x=12;y=345;z=6789",
    "Room 101, 2024-05-06T12:34:56Z",
    "I'm sure they'll say it's fine, don't you think? We've seen it. IT'S LOUD",
    "Punctuation!!! ??? ... --- (parens) [brackets] {braces} <angle> @#$%^&*",
    "I love 🍕 and 🎉!",
    "family 👨\u200d👩\u200d👧\u200d👦 and 👩\u200d💻, thumbs 👍🏽, flags 🇯🇵🇫🇷, heart ❤️",
    "日本語のテキストとカタカナ",
    "你好，世界！这是一个测试。",
    "한국어 텍스트입니다",
    "مرحبا بالعالم",
    "Café naïve résumé façade Ångström Zürich",
    "e\u0301 combining accent",
    "Россия и Україна",
    "<|im_start|>user\nhi<|im_end|>\n",
    "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text",
    "<|im_end|><|im_end|>",
    "<file_sep>src/main.py\n<jupyter_code>print(1)",
    "almost <|im_start but not quite |im_end|>",
    LONG_TEXT,
]

# Whitespace runs (or a space before a non-ASCII numeral) right before a digit:
# the original tokenizer.json isolates digits first, so the run stays one piece
# ("ĠĠ"); transformers' GGUF loader lets GPT-2's regex split a space off
# (" 1") and gives different ids.
DIGIT_SPLIT_TEXTS = [
    "x  1",
    "def f(x):\n    return x  +  1\n",
    "  12345 678",
    "values:\n    42\n    7",
    "col\t\t3",
    "مرحبا ٣٤٥",
    "½ ² x ²",
]


def short_id(text: str) -> str:
    return repr(text[:24]) + (f"+{len(text) - 24}" if len(text) > 24 else "")


@pytest.fixture(scope="module")
def default_model_path() -> Path:
    return resolve_model_path("default")


@pytest.fixture(scope="module")
def default_info(default_model_path: Path) -> TokenizerInfo:
    return load_tokenizer(open_gguf(default_model_path))


@pytest.fixture(scope="module")
def hf_default(default_model_path: Path) -> Any:
    return load_transformers_tokenizer(default_model_path)


@pytest.fixture(scope="module")
def original_default(hf_default: Any) -> Tokenizer:
    return with_pre_tokenizer(hf_default, DIGITS_THEN_GPT2_PRE)


@pytest.mark.slow
@pytest.mark.parametrize("text", CORPUS, ids=short_id)
def test_default_model_ids_match_transformers(default_info: TokenizerInfo, hf_default: Any, text: str) -> None:
    for add_special_tokens in (True, False):
        ours = default_info.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        assert ours == hf_default.encode(text, add_special_tokens=add_special_tokens), (text, add_special_tokens)


@pytest.mark.slow
@pytest.mark.parametrize("text", CORPUS + DIGIT_SPLIT_TEXTS, ids=short_id)
def test_default_model_ids_match_original_tokenizer_json(
    default_info: TokenizerInfo, original_default: Tokenizer, text: str
) -> None:
    for add_special_tokens in (True, False):
        ours = default_info.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        assert ours == original_default.encode(text, add_special_tokens=add_special_tokens).ids


@pytest.mark.slow
@pytest.mark.parametrize("text", DIGIT_SPLIT_TEXTS, ids=short_id)
def test_transformers_gguf_loader_differs_before_digits(
    default_info: TokenizerInfo, hf_default: Any, text: str
) -> None:
    """If this fails, transformers now splits digits like llama.cpp: move the text into CORPUS."""
    assert default_info.tokenizer.encode(text).ids != hf_default.encode(text)


@pytest.mark.slow
def test_default_model_keeps_whitespace_run_before_digit_whole(default_info: TokenizerInfo) -> None:
    tokens = default_info.tokenizer.encode("x  1", add_special_tokens=False).tokens
    assert tokens == ["x", "ĠĠ", "1"]


@pytest.mark.slow
@pytest.mark.parametrize("text", [t for t in CORPUS + DIGIT_SPLIT_TEXTS if "<" not in t], ids=short_id)
def test_default_model_decode_inverts_encode(default_info: TokenizerInfo, text: str) -> None:
    ids = default_info.tokenizer.encode(text, add_special_tokens=False).ids
    assert default_info.tokenizer.decode(ids, skip_special_tokens=False) == text


@pytest.mark.slow
@pytest.mark.parametrize("text", [t for t in CORPUS if "<" in t], ids=short_id)
def test_default_model_decode_of_special_tokens_matches_transformers(
    default_info: TokenizerInfo, hf_default: Any, text: str
) -> None:
    ids = default_info.tokenizer.encode(text, add_special_tokens=True).ids
    for skip in (False, True):
        assert default_info.tokenizer.decode(ids, skip_special_tokens=skip) == hf_default.decode(
            ids, skip_special_tokens=skip
        )
    assert default_info.tokenizer.decode(ids, skip_special_tokens=False) == text


@pytest.mark.slow
def test_default_model_special_tokens(default_info: TokenizerInfo) -> None:
    assert default_info.bos_token_id == 1 and default_info.bos_token == "<|im_start|>"
    assert default_info.eos_token_ids == (2,) and default_info.eos_token == "<|im_end|>"
    assert default_info.add_bos_token is False
    assert default_info.chat_template is not None and "<|im_start|>" in default_info.chat_template
    encoding = default_info.tokenizer.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=True)
    assert encoding.ids[0] == 1 and encoding.ids[-1] == 2  # matched whole, and no BOS added in front
    assert encoding.tokens[:2] == ["<|im_start|>", "user"]
    assert default_info.tokenizer.decode(encoding.ids, skip_special_tokens=True) == "user\nhi"


@pytest.mark.slow
def test_default_model_tokenizer_survives_json(default_info: TokenizerInfo) -> None:
    rebuilt = Tokenizer.from_str(default_info.to_json())
    for text in CORPUS + DIGIT_SPLIT_TEXTS:
        assert rebuilt.encode(text).ids == default_info.tokenizer.encode(text).ids
    assert rebuilt.get_vocab_size() == default_info.tokenizer.get_vocab_size() == 49152


# --------------------------------------------------------------------------------------
# Chat templates
# --------------------------------------------------------------------------------------

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "You write code."},
        {"role": "user", "content": "Reverse a list in Python."},
        {"role": "assistant", "content": "```python\nxs[::-1]\n```"},
        {"role": "user", "content": "And in place?"},
    ],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
    [{"role": "user", "content": "multi\nline\n\n  content with <|im_end|> inside"}],
]


@pytest.mark.slow
@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_default_chat_template_matches_transformers(
    default_info: TokenizerInfo, hf_default: Any, messages: list[dict[str, str]], add_generation_prompt: bool
) -> None:
    assert default_info.chat_template is not None
    ours = render_chat_template(
        default_info.chat_template,
        messages,
        add_generation_prompt=add_generation_prompt,
        bos_token=default_info.bos_token,
        eos_token=default_info.eos_token,
    )
    theirs = hf_default.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    assert ours.endswith("<|im_start|>assistant\n") == add_generation_prompt


@pytest.mark.slow
def test_default_chat_template_adds_system_prompt_only_when_missing(default_info: TokenizerInfo) -> None:
    assert default_info.chat_template is not None
    without = render_chat_template(default_info.chat_template, CONVERSATIONS[0])
    with_system = render_chat_template(default_info.chat_template, CONVERSATIONS[1])
    assert without.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert with_system.startswith("<|im_start|>system\nYou are terse.<|im_end|>\n")
    assert "SmolLM" not in with_system


CUSTOM_TEMPLATES = {
    "tojson_does_not_escape_html": "{{ messages | tojson }}",
    "tojson_indent": "{{ messages[0] | tojson(indent=2) }}",
    "loop_controls": "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}",
    "generation_tag": (
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}[{{ m.content }}]"
        "{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}"
    ),
    "trim_and_lstrip_blocks": (
        "{% for message in messages %}\n"
        "    {% if message.role == 'user' %}\n"
        "U: {{ message.content }}\n"
        "    {% else %}\n"
        "A: {{ message.content }}\n"
        "    {% endif %}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}\n"
        "A:\n"
        "{% endif %}\n"
    ),
    "bos_and_eos": "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}",
    "tools_default_none": "{% if tools is not none %}T{% else %}N{% endif %}{% if documents is none %}D{% endif %}",
    "namespace": "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}",
    "none_valued_keys_dropped": "{% for m in messages %}{{ 'tool_calls' in m }}{% endfor %}",
}

CUSTOM_MESSAGES = [
    {"role": "user", "content": "Is <b>\"this\" & 'that'</b> ü?"},
    {"role": "assistant", "content": "yes", "tool_calls": None},
    {"role": "user", "content": "ok"},
]


@pytest.mark.slow
@pytest.mark.parametrize("name", CUSTOM_TEMPLATES)
def test_custom_templates_render_like_transformers(hf_default: Any, name: str) -> None:
    template = CUSTOM_TEMPLATES[name]
    for add_generation_prompt in (True, False):
        ours = render_chat_template(
            template,
            CUSTOM_MESSAGES,
            add_generation_prompt=add_generation_prompt,
            bos_token=hf_default.bos_token,
            eos_token=hf_default.eos_token,
        )
        theirs = hf_default.apply_chat_template(
            CUSTOM_MESSAGES, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert ours == theirs


def test_tojson_keeps_html_and_unicode_literal() -> None:
    rendered = render_chat_template("{{ messages[0].content | tojson }}", CUSTOM_MESSAGES)
    assert rendered == '"Is <b>\\"this\\" & \'that\'</b> ü?"'


def test_extra_variables_reach_the_template() -> None:
    template = (
        "{% if enable_thinking is defined and not enable_thinking %}/no_think {% endif %}{{ messages[0].content }}"
    )
    messages = [{"role": "user", "content": "hi"}]
    assert render_chat_template(template, messages, enable_thinking=False) == "/no_think hi"
    assert render_chat_template(template, messages) == "hi"


def test_bad_role_is_rejected_by_name() -> None:
    with pytest.raises(InvalidMessagesError, match=r"message 1 has role 'robot'.*assistant, system, tool, user"):
        render_chat_template("{{ 1 }}", [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}])


def test_allowed_roles_can_be_widened() -> None:
    messages = [{"role": "robot", "content": "beep"}]
    assert render_chat_template("{{ messages[0].role }}", messages, allowed_roles={"robot"}) == "robot"


@pytest.mark.parametrize(
    ("messages", "pattern"),
    [
        ([{"content": "no role"}], r"message 0 has no 'role'"),
        ([{"role": "user"}], r"message 0 \(user\) has no 'content'"),
        ([{"role": "user", "content": 5}], r"message 0 \(user\) has 'content' of type int"),
        (["just a string"], r"message 0 must be a mapping, got str"),
        ("not a list", r"messages must be a list"),
    ],
)
def test_malformed_messages_are_rejected(messages: Any, pattern: str) -> None:
    with pytest.raises(InvalidMessagesError, match=pattern) as info:
        render_chat_template("{{ 1 }}", messages)
    assert isinstance(info.value, ValueError)


def test_raise_exception_becomes_chat_template_error() -> None:
    template = (
        "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}ok"
    )
    assert render_chat_template(template, [{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ChatTemplateError, match="rejected the conversation: first message must be from the user"):
        render_chat_template(template, [{"role": "assistant", "content": "x"}])


@pytest.mark.parametrize(
    ("template", "pattern"),
    [
        ("{% for m in messages %}{{ m.content }}", r"not valid Jinja \(line 1\)"),
        ("{{ messages[0].content + 1 }}", r"failed to render: TypeError"),
        ("{{ messages.append(1) }}", r"failed to render: SecurityError"),
        ("{{ messages.__class__.__mro__ }}", r"failed to render"),
        ("{{ messages[5].content }}", r"failed to render: UndefinedError"),
    ],
)
def test_broken_templates_become_chat_template_errors(template: str, pattern: str) -> None:
    with pytest.raises(ChatTemplateError, match=pattern) as info:
        render_chat_template(template, [{"role": "user", "content": "x"}])
    assert isinstance(info.value, ValueError)


def test_compiled_templates_are_cached() -> None:
    template = "{{ messages | length }} cached"
    assert compile_chat_template(template) is compile_chat_template(template)
    assert render_chat_template(template, [{"role": "user", "content": "x"}]) == "1 cached"


# --------------------------------------------------------------------------------------
# Tiny GGUF files written here
# --------------------------------------------------------------------------------------


def write_tiny_gguf(path: Path, metadata: dict[str, Any]) -> Path:
    """A GGUF holding only tokenizer metadata and one dummy tensor (a model needs one)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    if "model" in metadata:
        writer.add_tokenizer_model(metadata["model"])
    if metadata.get("pre") is not None:
        writer.add_tokenizer_pre(metadata["pre"])
    writer.add_token_list(metadata["tokens"])
    writer.add_token_types(metadata["token_types"])
    if "merges" in metadata:
        writer.add_token_merges(metadata["merges"])
    if "scores" in metadata:
        writer.add_token_scores(metadata["scores"])
    for key, add in (
        ("bos_id", writer.add_bos_token_id),
        ("eos_id", writer.add_eos_token_id),
        ("eot_id", writer.add_eot_token_id),
        ("unk_id", writer.add_unk_token_id),
        ("add_bos", writer.add_add_bos_token),
        ("add_space_prefix", writer.add_add_space_prefix),
        ("chat_template", writer.add_chat_template),
    ):
        if metadata.get(key) is not None:
            add(metadata[key])
    writer.add_tensor("token_embd.weight", np.zeros((len(metadata["tokens"]), 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def to_metadata(spec: dict[str, Any]) -> dict[str, Any]:
    """The metadata dict open_gguf would return for write_tiny_gguf(spec), without the file."""
    keys = {
        "model": "tokenizer.ggml.model",
        "pre": "tokenizer.ggml.pre",
        "tokens": "tokenizer.ggml.tokens",
        "token_types": "tokenizer.ggml.token_type",
        "merges": "tokenizer.ggml.merges",
        "scores": "tokenizer.ggml.scores",
        "bos_id": "tokenizer.ggml.bos_token_id",
        "eos_id": "tokenizer.ggml.eos_token_id",
        "eot_id": "tokenizer.ggml.eot_token_id",
        "unk_id": "tokenizer.ggml.unknown_token_id",
        "add_bos": "tokenizer.ggml.add_bos_token",
        "add_space_prefix": "tokenizer.ggml.add_space_prefix",
        "chat_template": "tokenizer.chat_template",
    }
    return {keys[k]: v for k, v in spec.items() if v is not None}


BYTE_LEVEL_TRAINING_TEXT = [
    "hello world, the quick brown fox jumps over the lazy dog",
    "def main():\n    return 42\n\nif __name__ == '__main__':\n    main()\n",
    "I'm sure they'll say it's 1,000,000 or 3.14159 in 2024 and 12345",
    "the the the hello hello world world 123 123 456 789",
    "日本語 テキスト café naïve   spaces\t\ttabs\n\n",
] * 4

BYTE_LEVEL_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def byte_level_vocab() -> dict[str, Any]:
    """A small byte-level BPE vocabulary, trained here: 256 byte symbols, merges, 3 control tokens, <think>."""
    trainer_tokenizer = Tokenizer(models.BPE())
    trainer_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=BYTE_LEVEL_SPECIALS,
        show_progress=False,
    )
    trainer_tokenizer.train_from_iterator(BYTE_LEVEL_TRAINING_TEXT, trainer)
    spec = json.loads(trainer_tokenizer.to_str())["model"]
    tokens = sorted(spec["vocab"], key=spec["vocab"].get)
    assert [spec["vocab"][t] for t in tokens] == list(range(len(tokens)))
    merges = [" ".join(m) if isinstance(m, list) else m for m in spec["merges"]]
    assert len(merges) > 50
    tokens.append("<think>")
    token_types = [gguf.TokenType.CONTROL if t in BYTE_LEVEL_SPECIALS else gguf.TokenType.NORMAL for t in tokens]
    token_types[-1] = gguf.TokenType.USER_DEFINED
    return {
        "model": "gpt2",
        "tokens": tokens,
        "token_types": [int(t) for t in token_types],
        "merges": merges,
        "bos_id": 1,
        "eos_id": 2,
        "add_bos": False,
    }


BYTE_LEVEL_CORPUS = [
    "",
    "hello world",
    "HelloWorld IT'S (ok) x  12345 e\u0301\n\n  y",
    "def f(x):\n\treturn x + 1\n",
    "I'm sure they'll say it's 1,000,000 and 3.14159",
    "IT'S 2024! We'VE 123456789 won",
    "日本語のテキスト café  naïve",
    "emoji 👩\u200d👩\u200d👧 🎉",
    "<|im_start|>user\nhi<|im_end|>\n",
    "<think>hmm</think> ok",
    "   \n\n\t  trailing   ",
    "Ünïcödé ÀÉÎ 𝔘𝔫𝔦",
]

# `tokenizer.ggml.pre` -> which split it must use. Kept by hand, independent of the code's table.
PRE_FAMILIES = {
    "default": "gpt2",
    "gpt2": "gpt2",
    "gpt-2": "gpt2",
    "phi-2": "gpt2",
    "mpt": "gpt2",
    "olmo": "gpt2",
    "jais": "gpt2",
    "trillion": "gpt2",
    "granite-docling": "gpt2",
    "smollm": "digits_gpt2",
    "starcoder": "digits_gpt2",
    "refact": "digits_gpt2",
    "command-r": "digits_gpt2",
    "codeshell": "digits_gpt2",
    "exaone": "digits_gpt2",
    "llama3": "llama3",
    "llama-v3": "llama3",
    "llama-bpe": "llama3",
    "falcon3": "llama3",
    "falcon-h1": "llama3",
    "pixtral": "llama3",
    "midm-2.0": "llama3",
    "lfm2": "llama3",
    "dbrx": "llama3",
    "smaug-bpe": "llama3",
    "qwen2": "qwen2",
    "deepseek-r1-qwen": "qwen2",
    "megrez": "qwen2",
    "stablelm2": "qwen2",
    "qwen35": "qwen35",
    "tekken": "tekken",
}

# llama.cpp sets ignore_merges (a word that is a token is taken whole) for these.
IGNORE_MERGES_PRES = {
    "llama3",
    "llama-v3",
    "llama-bpe",
    "falcon3",
    "falcon-h1",
    "pixtral",
    "midm-2.0",
    "lfm2",
    "tekken",
}

# Names whose split transformers' GGUF loader does not know: it falls back to GPT-2's regex.
TRANSFORMERS_MISREADS = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "stablelm2"}

PROBE = "HelloWorld IT'S (ok) x  12345 e\u0301\n\n  y"

# How each family cuts PROBE, worked out from its regex by hand.
PROBE_PIECES = {
    # GPT-2: "'s" only in lower case; " ?\p{N}+" takes the space before the digits.
    "gpt2": ["HelloWorld", "ĠIT", "'", "S", "Ġ(", "ok", ")", "Ġx", "Ġ", "Ġ12345", "Ġe", "Ìģ", "ĊĊĠ", "Ġy"],
    # digits isolated first, so "x  " ends in a two-space run
    "digits_gpt2": [
        "HelloWorld",
        "ĠIT",
        "'",
        "S",
        "Ġ(",
        "ok",
        ")",
        "Ġx",
        "ĠĠ",
        "1",
        "2",
        "3",
        "4",
        "5",
        "Ġe",
        "Ìģ",
        "ĊĊĠ",
        "Ġy",
    ],
    # case-insensitive contractions, digits in threes, the mark glued to the newlines
    "llama3": ["HelloWorld", "ĠIT", "'S", "Ġ(", "ok", ")", "Ġx", "Ġ", "Ġ", "123", "45", "Ġe", "ÌģĊĊ", "Ġ", "Ġy"],
    "qwen2": [
        "HelloWorld",
        "ĠIT",
        "'S",
        "Ġ(",
        "ok",
        ")",
        "Ġx",
        "Ġ",
        "Ġ",
        "1",
        "2",
        "3",
        "4",
        "5",
        "Ġe",
        "ÌģĊĊ",
        "Ġ",
        "Ġy",
    ],
    # combining marks count as letters
    "qwen35": [
        "HelloWorld",
        "ĠIT",
        "'S",
        "Ġ(",
        "ok",
        ")",
        "Ġx",
        "Ġ",
        "Ġ",
        "1",
        "2",
        "3",
        "4",
        "5",
        "ĠeÌģ",
        "ĊĊ",
        "Ġ",
        "Ġy",
    ],
    # camel case is split
    "tekken": [
        "Hello",
        "World",
        "ĠIT",
        "'S",
        "Ġ(",
        "ok",
        ")",
        "Ġx",
        "Ġ",
        "Ġ",
        "1",
        "2",
        "3",
        "4",
        "5",
        "ĠeÌģ",
        "ĊĊ",
        "Ġ",
        "Ġy",
    ],
}

QWEN2_SPLIT_PRE = {
    "type": "Sequence",
    "pretokenizers": [
        {
            "type": "Split",
            "pattern": {
                "Regex": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
            },
            "behavior": "Isolated",
            "invert": False,
        },
        byte_level(use_regex=False),
    ],
}

# What the model's tokenizer.json uses, for the names transformers misreads.
ORIGINAL_PRE_FOR_FAMILY = {"digits_gpt2": DIGITS_THEN_GPT2_PRE, "qwen2": QWEN2_SPLIT_PRE}


def test_every_supported_pre_tokenizer_is_covered() -> None:
    assert set(BYTE_LEVEL_SPLITS) - {None} == set(PRE_FAMILIES)


@pytest.mark.parametrize("pre", sorted(PRE_FAMILIES))
def test_pre_tokenizer_cuts_probe_as_its_regex_says(byte_level_vocab: dict[str, Any], pre: str) -> None:
    tokenizer = build_tokenizer(to_metadata({**byte_level_vocab, "pre": pre}))
    pieces = [piece for piece, _ in tokenizer.pre_tokenizer.pre_tokenize_str(PROBE)]
    assert pieces == PROBE_PIECES[PRE_FAMILIES[pre]]


def test_missing_pre_uses_gpt2_regex(byte_level_vocab: dict[str, Any]) -> None:
    tokenizer = build_tokenizer(to_metadata({**byte_level_vocab, "pre": None}))
    assert [p for p, _ in tokenizer.pre_tokenizer.pre_tokenize_str(PROBE)] == PROBE_PIECES["gpt2"]


@pytest.mark.slow
@pytest.mark.parametrize("pre", [None, *sorted(PRE_FAMILIES)])
def test_tiny_byte_level_file_matches_transformers(
    tmp_path: Path, byte_level_vocab: dict[str, Any], pre: str | None
) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf", {**byte_level_vocab, "pre": pre})
    ours = load_tokenizer(open_gguf(path)).tokenizer
    hf = load_transformers_tokenizer(path)
    if pre in TRANSFORMERS_MISREADS:
        reference = with_pre_tokenizer(hf, ORIGINAL_PRE_FOR_FAMILY[PRE_FAMILIES[pre]])
        assert any(ours.encode(t).ids != hf.encode(t) for t in BYTE_LEVEL_CORPUS), "the corpus must show the misread"
    else:
        reference = hf.backend_tokenizer
    for text in BYTE_LEVEL_CORPUS:
        for add_special_tokens in (True, False):
            expected = reference.encode(text, add_special_tokens=add_special_tokens).ids
            assert ours.encode(text, add_special_tokens=add_special_tokens).ids == expected, (text, pre)
        ids = ours.encode(text).ids
        assert ours.decode(ids, skip_special_tokens=False) == text
        assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


def test_tiny_byte_level_special_and_user_defined_tokens(byte_level_vocab: dict[str, Any]) -> None:
    tokenizer = build_tokenizer(to_metadata({**byte_level_vocab, "pre": "qwen2"}))
    tokens = byte_level_vocab["tokens"]
    encoding = tokenizer.encode("<|im_start|>user<think>x</think><|im_end|>")
    assert encoding.ids[0] == tokens.index("<|im_start|>")
    think_at = encoding.tokens.index("<think>")  # matched whole, not cut into "<", "think", ">"
    assert encoding.ids[think_at] == tokens.index("<think>")
    assert encoding.tokens.count("<think>") == 1  # "</think>" is no token: it is cut into pieces
    assert encoding.ids[-1] == tokens.index("<|im_end|>")
    assert tokenizer.get_vocab_size(with_added_tokens=True) == len(tokens)  # added tokens kept their file ids
    kept = tokenizer.decode(encoding.ids, skip_special_tokens=True)
    assert kept == "user<think>x</think>"  # user-defined tokens are not special


@pytest.mark.parametrize("pre", sorted(PRE_FAMILIES))
def test_ignore_merges_takes_a_whole_word_token(byte_level_vocab: dict[str, Any], pre: str) -> None:
    """llama.cpp (and Llama 3's tokenizer.json) take a word that is a token whole, even with no merges
    leading to it; transformers' GGUF loader does not set ignore_merges."""
    whole = "Ġzqxj"
    vocab = {**byte_level_vocab, "pre": pre, "tokens": [*byte_level_vocab["tokens"], whole]}
    vocab["token_types"] = [*byte_level_vocab["token_types"], int(gguf.TokenType.NORMAL)]
    tokens = build_tokenizer(to_metadata(vocab)).encode(" zqxj", add_special_tokens=False).tokens
    assert tokens == ([whole] if pre in IGNORE_MERGES_PRES else ["Ġ", "z", "q", "x", "j"])


def test_control_token_outside_byte_alphabet_is_recognised(byte_level_vocab: dict[str, Any]) -> None:
    end = "<｜end▁of▁sentence｜>"
    vocab = {**byte_level_vocab, "pre": "llama-bpe", "tokens": [*byte_level_vocab["tokens"], end]}
    vocab["token_types"] = [*byte_level_vocab["token_types"], int(gguf.TokenType.CONTROL)]
    tokenizer = build_tokenizer(to_metadata(vocab))
    end_id = len(vocab["tokens"]) - 1
    encoding = tokenizer.encode(f"hi{end}", add_special_tokens=False)
    assert encoding.ids[-1] == end_id and encoding.tokens[-1] == end
    assert tokenizer.decode(encoding.ids, skip_special_tokens=False) == f"hi{end}"
    assert tokenizer.decode(encoding.ids, skip_special_tokens=True) == "hi"


def test_llama3_pre_adds_bos_when_the_file_has_no_flag(byte_level_vocab: dict[str, Any]) -> None:
    metadata = to_metadata({**byte_level_vocab, "pre": "llama-bpe", "add_bos": None})
    assert build_tokenizer(metadata).encode("hi").ids[0] == 1
    metadata = to_metadata({**byte_level_vocab, "pre": "qwen2", "add_bos": None})
    assert build_tokenizer(metadata).encode("hi").ids[0] != 1


def test_bos_is_added_only_when_asked(byte_level_vocab: dict[str, Any]) -> None:
    with_bos = build_tokenizer(to_metadata({**byte_level_vocab, "pre": "qwen2", "add_bos": True}))
    without = build_tokenizer(to_metadata({**byte_level_vocab, "pre": "qwen2", "add_bos": False}))
    body = without.encode("hi there", add_special_tokens=True).ids
    assert with_bos.encode("hi there", add_special_tokens=True).ids == [1, *body]
    assert with_bos.encode("hi there", add_special_tokens=False).ids == body
    assert with_bos.encode("", add_special_tokens=True).ids == [1]


def test_eot_token_joins_eos_ids(tmp_path: Path, byte_level_vocab: dict[str, Any]) -> None:
    path = write_tiny_gguf(tmp_path / "eot.gguf", {**byte_level_vocab, "pre": "qwen2", "eot_id": 0})
    info = load_tokenizer(open_gguf(path))
    assert info.eos_token_ids == (2, 0)
    assert info.eos_token == "<|im_end|>"
    path = write_tiny_gguf(tmp_path / "same.gguf", {**byte_level_vocab, "pre": "qwen2", "eot_id": 2})
    assert load_tokenizer(open_gguf(path)).eos_token_ids == (2,)


# A handmade sentencepiece vocabulary: <unk> <s> </s>, 256 byte tokens, "▁" pieces with scores.
SPM_PIECES = [
    f"{SPM_SPACE}t",
    "he",
    f"{SPM_SPACE}the",
    "ll",
    "llo",
    f"{SPM_SPACE}he",
    f"{SPM_SPACE}hello",
    "or",
    "ld",
    f"{SPM_SPACE}w",
    f"{SPM_SPACE}wor",
    f"{SPM_SPACE}world",
    f"{SPM_SPACE}a",
    "in",
    "ing",
    f"{SPM_SPACE}th",
    "is",
    f"{SPM_SPACE}is",
    SPM_SPACE * 2,
    SPM_SPACE * 4,
    "Th",
    f"{SPM_SPACE}Th",
]
SPM_CHARS = list("abcdefghijklmnopqrstuvwxyzHTW.,!?'") + [SPM_SPACE]


@pytest.fixture(scope="module")
def spm_vocab() -> dict[str, Any]:
    tokens = ["<unk>", "<s>", "</s>"]
    token_types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    scores = [0.0, 0.0, 0.0]
    for byte in range(256):
        tokens.append(f"<0x{byte:02X}>")
        token_types.append(gguf.TokenType.BYTE)
        scores.append(0.0)
    for rank, piece in enumerate(SPM_PIECES):
        tokens.append(piece)
        token_types.append(gguf.TokenType.NORMAL)
        scores.append(-float(rank))
    for rank, char in enumerate(SPM_CHARS):
        tokens.append(char)
        token_types.append(gguf.TokenType.NORMAL)
        scores.append(-100.0 - rank)
    tokens += ["<think>", "<|user|>"]
    token_types += [gguf.TokenType.USER_DEFINED, gguf.TokenType.CONTROL]
    scores += [0.0, 0.0]
    return {
        "model": "llama",
        "tokens": tokens,
        "token_types": [int(t) for t in token_types],
        "scores": scores,
        "bos_id": 1,
        "eos_id": 2,
        "unk_id": 0,
        "add_bos": True,
        "add_space_prefix": True,
    }


SPM_CORPUS = [
    "",
    " ",
    "hello world",
    " hello  world",
    "The thing is ing",
    "hello\nworld\t!",
    "    four spaces",
    "Zürich 日本 😀",
    "<s>hello</s> world",
    "<|user|>hi<think>hmm</think>  x",
    "<unk> x",
    "trailing ",
]


def spm_token_id(spm_vocab: dict[str, Any], token: str) -> int:
    return spm_vocab["tokens"].index(token)


@pytest.mark.slow
def test_tiny_sentencepiece_file_matches_transformers(tmp_path: Path, spm_vocab: dict[str, Any]) -> None:
    path = write_tiny_gguf(tmp_path / "spm.gguf", spm_vocab)
    info = load_tokenizer(open_gguf(path))
    hf = load_transformers_tokenizer(path)
    for text in SPM_CORPUS:
        for add_special_tokens in (True, False):
            ours = info.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
            assert ours == hf.encode(text, add_special_tokens=add_special_tokens), (text, add_special_tokens)
        ids = info.tokenizer.encode(text).ids
        for skip in (False, True):
            assert info.tokenizer.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


@pytest.mark.slow
def test_tiny_sentencepiece_adds_bos_without_flag_like_transformers(tmp_path: Path, spm_vocab: dict[str, Any]) -> None:
    path = write_tiny_gguf(tmp_path / "spm.gguf", {**spm_vocab, "add_bos": None})
    info = load_tokenizer(open_gguf(path))
    assert info.add_bos_token is True
    assert (
        info.tokenizer.encode("hello").ids
        == load_transformers_tokenizer(path).encode("hello")
        == [
            1,
            spm_token_id(spm_vocab, f"{SPM_SPACE}hello"),
        ]
    )


def test_sentencepiece_pieces_and_byte_fallback(spm_vocab: dict[str, Any]) -> None:
    tokenizer = build_tokenizer(to_metadata(spm_vocab))
    encoding = tokenizer.encode("hello world", add_special_tokens=True)
    assert encoding.tokens == ["<s>", f"{SPM_SPACE}hello", f"{SPM_SPACE}world"]
    # "日" is no piece: its three UTF-8 bytes stand in
    assert tokenizer.encode("日", add_special_tokens=False).tokens == [SPM_SPACE, "<0xE6>", "<0x97>", "<0xA5>"]
    assert tokenizer.decode(tokenizer.encode("日 x").ids, skip_special_tokens=True) == "日 x"
    # pieces are merged best score first: "he" outranks "Th", so "The" cannot become "▁Th"+"e"
    assert tokenizer.encode("The", add_special_tokens=False).tokens == [SPM_SPACE, "T", "he"]
    think = tokenizer.encode("a<think>b", add_special_tokens=False)
    assert spm_token_id(spm_vocab, "<think>") in think.ids


def test_sentencepiece_without_space_prefix(spm_vocab: dict[str, Any]) -> None:
    """transformers ignores add_space_prefix = false; llama.cpp (and we) honour it."""
    tokenizer = build_tokenizer(to_metadata({**spm_vocab, "add_space_prefix": False}))
    encoding = tokenizer.encode("hello world", add_special_tokens=False)
    assert encoding.tokens == ["he", "llo", f"{SPM_SPACE}world"]
    assert tokenizer.decode(encoding.ids) == "hello world"
    assert tokenizer.decode(tokenizer.encode(" hi").ids) == " hi"  # no leading space stripped either


def test_sentencepiece_tokenizer_survives_json(spm_vocab: dict[str, Any]) -> None:
    tokenizer = build_tokenizer(to_metadata(spm_vocab))
    rebuilt = Tokenizer.from_str(tokenizer.to_str())
    for text in SPM_CORPUS:
        assert rebuilt.encode(text).ids == tokenizer.encode(text).ids
    assert rebuilt.encode("hi").ids[0] == 1  # the BOS post-processor travels too


def test_merges_from_scores_rank_by_the_merged_tokens_score() -> None:
    vocab = {"a": 0, "b": 1, "c": 2, "ab": 3, "bc": 4, "abc": 5}
    scores = {"a": -10.0, "b": -11.0, "c": -12.0, "ab": -1.0, "bc": -2.0, "abc": -0.5}
    assert merges_from_scores(vocab, scores) == [("ab", "c"), ("a", "bc"), ("a", "b"), ("b", "c")]


# --------------------------------------------------------------------------------------
# What is refused
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["bert", "t5", "rwkv"])
def test_unsupported_tokenizer_type_is_refused(tmp_path: Path, spm_vocab: dict[str, Any], model: str) -> None:
    path = write_tiny_gguf(tmp_path / f"{model}.gguf", {**spm_vocab, "model": model})
    with pytest.raises(ModelLoadError, match=rf"{model}\.gguf: tokenizer type '{model}'.*supported.*gpt2, llama"):
        load_tokenizer(open_gguf(path))


def test_missing_tokenizer_type_is_refused(tmp_path: Path, spm_vocab: dict[str, Any]) -> None:
    spec = {k: v for k, v in spm_vocab.items() if k != "model"}
    path = write_tiny_gguf(tmp_path / "none.gguf", spec)
    with pytest.raises(ModelLoadError, match=r"no tokenizer\.ggml\.model.*gpt2, llama"):
        load_tokenizer(open_gguf(path))


def test_unknown_pre_tokenizer_is_refused(byte_level_vocab: dict[str, Any]) -> None:
    with pytest.raises(ModelLoadError, match=r"pre-tokenizer 'deepseek-llm'.*not supported.*llama-bpe.*smollm"):
        build_tokenizer(to_metadata({**byte_level_vocab, "pre": "deepseek-llm"}))


def test_add_bos_without_bos_id_is_refused(byte_level_vocab: dict[str, Any]) -> None:
    metadata = to_metadata({**byte_level_vocab, "pre": "qwen2", "add_bos": True, "bos_id": None})
    with pytest.raises(ModelLoadError, match="add_bos_token is set but tokenizer.ggml.bos_token_id is missing"):
        build_tokenizer(metadata)


def test_byte_level_without_merges_is_refused(byte_level_vocab: dict[str, Any]) -> None:
    metadata = to_metadata({k: v for k, v in byte_level_vocab.items() if k != "merges"})
    with pytest.raises(ModelLoadError, match="needs tokenizer.ggml.merges"):
        build_tokenizer(metadata)
