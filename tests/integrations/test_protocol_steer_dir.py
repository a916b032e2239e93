"""``--steer-dir``'s names: every suffix a steer file may have (the project's safetensors
and llama.cpp's control-vector GGUF), as presets, admission and first use see them."""

from __future__ import annotations

from vllm_steer.integrations.protocol import dir_has_file, dir_path, steer_dir_names


def test_a_gguf_only_steer_is_a_name_of_the_directory(tmp_path):
    (tmp_path / "calm.gguf").write_bytes(b"GGUF")
    (tmp_path / "detox.safetensors").write_bytes(b"x")
    (tmp_path / "both.safetensors").write_bytes(b"x")
    (tmp_path / "both.gguf").write_bytes(b"GGUF")
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / ".gguf").write_bytes(b"GGUF")  # no name
    assert steer_dir_names(str(tmp_path)) == {"calm", "detox", "both"}
    assert dir_has_file(str(tmp_path), "calm") and not dir_has_file(str(tmp_path), "notes")
    assert dir_path(str(tmp_path), "calm").endswith("calm.gguf")
    assert dir_path(str(tmp_path), "both").endswith("both.safetensors")  # safetensors first
    assert dir_path(str(tmp_path), "nope").endswith("nope.safetensors")  # what is looked for
    assert steer_dir_names(None) == set() == steer_dir_names(str(tmp_path / "missing"))
