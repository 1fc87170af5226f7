"""open_gguf parses the header itself: the same metadata and tensors as the gguf package's
GGUFReader on every kind of file we load, much faster on a real vocabulary, and a clear
ModelLoadError on a damaged file."""

from __future__ import annotations

import time

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFEndian, GGUFReader, GGUFWriter
from hypothesis import given, settings
from hypothesis import strategies as st

from executor_svc.errors import ModelLoadError
from executor_svc.weights.gguf_file import open_gguf
from tests.support.tiny_gguf import TinyModelSpec, write_tiny_model
from tests.support.tiny_hybrid_gguf import write_tiny_hybrid_model

Q = GGMLQuantizationType
K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)


def reader_view(path) -> tuple[dict, dict]:
    """What GGUFReader makes of the file: (metadata, {name: (shape, type, raw)})."""
    reader = GGUFReader(path, "r")
    metadata = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    tensors = {
        t.name: (tuple(int(n) for n in reversed(t.shape.tolist())), Q(t.tensor_type), t.data) for t in reader.tensors
    }
    return metadata, tensors


def assert_same_as_reader(path) -> None:
    gguf = open_gguf(path)
    metadata, tensors = reader_view(path)
    assert list(gguf.metadata) == list(metadata)
    for key, value in metadata.items():
        assert gguf.metadata[key] == value and type(gguf.metadata[key]) is type(value), key
        if isinstance(value, list) and value:
            assert {type(v) for v in gguf.metadata[key]} == {type(v) for v in value}, key
    assert list(gguf.tensors) == list(tensors)
    for name, (shape, tensor_type, raw) in tensors.items():
        tensor = gguf.tensors[name]
        assert (tensor.shape, tensor.tensor_type) == (shape, tensor_type), name
        assert tensor.raw.dtype == raw.dtype and tensor.raw.shape == raw.shape, name
        assert np.asarray(tensor.raw).tobytes() == np.asarray(raw).tobytes(), name


@pytest.mark.parametrize("tensor_type", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, *K_QUANTS], ids=lambda t: t.name)
def test_tiny_models_read_as_the_gguf_reader_reads_them(tmp_path, tensor_type):
    width = 256 if tensor_type in K_QUANTS else 64  # K-quant rows are whole 256-value blocks
    spec = TinyModelSpec(tensor_type=tensor_type, hidden_size=width, intermediate_size=2 * width, architecture="qwen3")
    assert_same_as_reader(write_tiny_model(tmp_path / "tiny.gguf", spec))


def test_a_hybrid_model_reads_as_the_gguf_reader_reads_it(tmp_path):
    _, path = write_tiny_hybrid_model(tmp_path / "hybrid.gguf")
    assert_same_as_reader(path)


def test_every_value_type_nested_arrays_and_big_endian(tmp_path):
    for endianess in (GGUFEndian.LITTLE, GGUFEndian.BIG):
        path = tmp_path / f"values-{endianess.name}.gguf"
        writer = GGUFWriter(str(path), "llama", endianess=endianess)
        writer.add_uint8("t.u8", 255)
        writer.add_int8("t.i8", -128)
        writer.add_uint16("t.u16", 65535)
        writer.add_int16("t.i16", -32768)
        writer.add_uint32("t.u32", 2**32 - 1)
        writer.add_int32("t.i32", -(2**31))
        writer.add_float32("t.f32", 0.1)
        writer.add_uint64("t.u64", 2**64 - 1)
        writer.add_int64("t.i64", -(2**63))
        writer.add_float64("t.f64", 0.1)
        writer.add_bool("t.bool", True)
        writer.add_string("t.str", "naïve ☃")
        writer.add_array("t.ints", [1, -2, 3])
        writer.add_array("t.floats", [0.5, 0.25])
        writer.add_array("t.strs", ["a", "", "ü"])
        writer.add_array("t.nested", [[1, 2], [3]])
        writer.add_array("t.empty", [])
        writer.add_tensor("token_embd.weight", np.arange(32, dtype=np.float32).reshape(4, 8))
        writer.add_tensor("blk.0.ffn_up.weight", np.ones((2, 16), dtype=np.float16))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        assert_same_as_reader(path)
        assert open_gguf(path).tensors["token_embd.weight"].dequantize()[3, 7] == 31


def test_the_embedded_models_vocabulary_reads_fast(default_model_path):
    """~100,000 strings of tokenizer metadata: GGUFReader took seconds; one pass takes a fraction."""
    t0 = time.perf_counter()
    gguf = open_gguf(default_model_path)
    ours = time.perf_counter() - t0
    t0 = time.perf_counter()
    metadata, _ = reader_view(default_model_path)
    theirs = time.perf_counter() - t0
    assert gguf.metadata == metadata
    assert ours < theirs / 5, f"open_gguf {ours:.2f} s vs GGUFReader {theirs:.2f} s"


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_a_damaged_file_is_a_model_load_error(tmp_path_factory, data):
    """Cut short or with bytes overwritten anywhere in its header: ModelLoadError, or (a change
    that still parses, say inside a string) a file that opens; never another exception."""
    path = tmp_path_factory.mktemp("damaged") / "d.gguf"
    original = write_tiny_model(path.with_name("tiny.gguf"), TinyModelSpec()).read_bytes()
    header_end = 4096
    if data.draw(st.booleans(), label="cut"):
        damaged = original[: data.draw(st.integers(0, len(original) - 1), label="length")]
    else:
        at = data.draw(st.integers(4, header_end), label="at")
        junk = data.draw(st.binary(min_size=1, max_size=8), label="junk")
        damaged = original[:at] + junk + original[at + len(junk) :]
    path.write_bytes(damaged)
    try:
        open_gguf(path)
    except ModelLoadError as exc:
        assert str(path) in str(exc)
