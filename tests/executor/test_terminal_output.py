"""What a person at a terminal sees: console logs on a TTY (JSON lines elsewhere), and a
progress bar while a large GGUF loads."""

from __future__ import annotations

import io

import torch

from executor_svc.load_progress import load_progress
from executor_svc.weights.gguf_file import open_gguf
from executor_svc.weights.model_config import ModelConfig
from executor_svc.weights.model_weights import load_weights
from service_common.observability.logs import resolve_log_format
from tests.support.tiny_gguf import TinyModelSpec


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_auto_log_format_is_console_on_a_terminal_and_json_elsewhere():
    assert resolve_log_format("auto", Terminal()) == "console"
    assert resolve_log_format("auto", io.StringIO()) == "json"
    assert resolve_log_format("json", Terminal()) == "json"
    assert resolve_log_format("console", io.StringIO()) == "console"


def test_a_bar_follows_the_weights_as_they_load_on_a_terminal(tiny_gguf_path):
    gguf = open_gguf(tiny_gguf_path(TinyModelSpec()))
    config = ModelConfig.from_gguf(gguf)
    terminal = Terminal()
    with load_progress(gguf, terminal, min_bytes=0) as loading:
        assert (
            "token_embd.weight" in loading.tensors and "100%" not in terminal.getvalue()
        )  # a membership test reads nothing
        weights = load_weights(loading, config, torch.float32, torch.device("cpu"))
        drawn = terminal.getvalue()
    assert weights.num_bytes > 0
    assert f"loading {gguf.path.name}" in drawn and "100%" in drawn
    assert len(drawn.split("\r")) > 2  # it moved while loading, not only at the end


def test_no_bar_off_a_terminal_or_for_a_small_file(tiny_gguf_path):
    gguf = open_gguf(tiny_gguf_path(TinyModelSpec()))
    pipe = io.StringIO()
    with load_progress(gguf, pipe, min_bytes=0) as loading:
        assert loading is gguf
    with load_progress(gguf, Terminal()) as loading:  # a tiny file is under the default threshold
        assert loading is gguf
    assert pipe.getvalue() == ""
