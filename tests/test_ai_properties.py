"""The draft AI properties' facts read from weight files: ParameterCount of GGUF (metadata skipped without decoding,
arrays of strings and numbers included), safetensors and ONNX files, and the content digest."""
from __future__ import annotations

import hashlib

import gguf
import numpy as np
import torch
from safetensors.torch import save_file

from uaserver.ai_properties import digest, parameter_count


def test_gguf_parameter_count_equals_the_gguf_readers(tmp_path):
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("general.name", "tiny")
    w.add_array("tokenizer.ggml.tokens", ["a", "bb", "ccc"] * 50)
    w.add_array("tokenizer.ggml.scores", [0.5] * 150)
    w.add_uint32("llama.context_length", 64)
    w.add_tensor("a", np.zeros((3, 32), np.float32))
    w.add_tensor("b", np.ones((5,), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    expected = sum(int(t.n_elements) for t in gguf.GGUFReader(str(path)).tensors)
    assert parameter_count(path) == expected == 3 * 32 + 5


def test_safetensors_directory_and_digest(tmp_path):
    save_file({"w": torch.zeros(4, 6), "b": torch.zeros(6)}, str(tmp_path / "model.safetensors"))
    assert parameter_count(tmp_path) == 30
    one = tmp_path / "model.safetensors"
    assert digest(one) == hashlib.sha256(one.read_bytes()).hexdigest()
    assert len(digest(tmp_path)) == 64 and digest(tmp_path) != digest(one)  # a directory: names and contents
    assert parameter_count(tmp_path / "missing.gguf") == 0 and digest(tmp_path / "missing") == ""
