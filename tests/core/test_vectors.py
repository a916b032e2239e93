"""Vector steers (vllm_steer.vectors): llama.cpp's control-vector GGUF read as repeng and
llama.cpp's generator write it (with the gguf package's own writer), our safetensors kind,
the round trip bit for bit, every refusal listed, the check against a model, and the math
(vllm_steer.reference.vector_steer_reference) against transformers' own hidden states."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch

from vllm_steer.format import (KIND_VECTOR, SteerFileError, load_steer, make_steer,
                               read_metadata, save_steer)
from vllm_steer.hf import decoder_layers, vector_steering
from vllm_steer.reference import vector_steer_reference
from vllm_steer.vectors import (MAX_LAYERS, VectorFileError, check_fits_model, load_gguf,
                                load_vector, make_vector_steer, model_fit_problems,
                                parse_layers, read_vector_metadata, save_gguf, save_vector)

gguf = pytest.importorskip("gguf")

HIDDEN = 16


def _dirs(layers, seed=0, hidden=HIDDEN):
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(hidden).astype(np.float32) for k in layers}


def write_repeng_gguf(path, dirs, model_hint="llama"):
    """A control vector written the way repeng's ``ControlVector.export_gguf`` does."""
    w = gguf.GGUFWriter(str(path), "controlvector")
    w.add_string("controlvector.model_hint", model_hint)
    w.add_uint32("controlvector.layer_count", len(dirs))
    for k in dirs:
        w.add_tensor(f"direction.{k}", dirs[k])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_llamacpp_gguf(path, dirs, arch="controlvector", dtype=None, extra_tensors=()):
    """As llama.cpp's control-vector generator writes it (layer_count an int32), or with the
    given defects."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_string(f"{arch}.model_hint", "llama")
    w.add_int32(f"{arch}.layer_count", len(dirs))
    for k, v in dirs.items():
        w.add_tensor(f"direction.{k}", v if dtype is None else v.astype(dtype))
    for name, v in extra_tensors:
        w.add_tensor(name, v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_gguf(path, fields, dirs):
    """A control-vector GGUF with ``fields`` (``(GGUFWriter method, key, value)`` each, in
    order) and the directions ``dirs``, written with the ``gguf`` package (not ours)."""
    w = gguf.GGUFWriter(str(path), "controlvector")
    for add, key, value in fields:
        getattr(w, add)(key, value)
    for k, v in dirs.items():
        w.add_tensor(f"direction.{k}", v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def raw_tensors(path):
    """name -> raw bytes, read with gguf's reader (not ours)."""
    r = gguf.GGUFReader(str(path))
    return {t.name: bytes(np.asarray(t.data).tobytes()) for t in r.tensors}, r


def test_repeng_gguf_reads_and_round_trips_bit_for_bit(tmp_path):
    dirs = _dirs(range(1, 6))
    dirs[3][0] = np.float32(-0.0)  # bits, not values: -0.0 must survive
    dirs[3][1] = np.float32(1e-45)  # a subnormal too
    src = tmp_path / "calm.gguf"
    write_repeng_gguf(src, dirs)
    vs = load_vector(src)
    assert vs.layers == [1, 2, 3, 4, 5] and vs.hidden_size == HIDDEN
    assert vs.metadata.model_type == "llama" and vs.name == "calm"
    assert vs.metadata.source["keys"]["controlvector.layer_count"] == 5
    for k, v in dirs.items():
        assert vs.directions[k].numpy().tobytes() == v.tobytes()
    ours = tmp_path / "calm.safetensors"
    save_vector(ours, vs)
    assert read_vector_metadata(ours).kind == KIND_VECTOR
    back = tmp_path / "back.gguf"
    save_gguf(back, load_vector(ours))
    want, _ = raw_tensors(src)
    got, reader = raw_tensors(back)
    assert got == want  # every tensor, every bit, and no other tensor
    f = reader.get_field
    assert f("general.architecture").contents() == "controlvector"
    assert f("controlvector.model_hint").contents() == "llama"
    assert f("controlvector.layer_count").contents() == 5
    # our metadata travelled through the GGUF
    assert load_vector(back).metadata.source == vs.metadata.source


def test_llamacpp_generator_gguf_reads(tmp_path):
    dirs = _dirs(range(1, 4), seed=1)
    p = tmp_path / "gen.gguf"
    write_llamacpp_gguf(p, dirs)
    vs = load_gguf(p, name="gen")
    assert vs.layers == [1, 2, 3]
    assert all(np.array_equal(vs.directions[k].numpy(), dirs[k]) for k in dirs)


def test_bad_gguf_lists_every_reason(tmp_path):
    dirs = _dirs([1, 2])
    dirs[2] = np.full(HIDDEN, np.nan, np.float32)
    p = tmp_path / "bad.gguf"
    write_llamacpp_gguf(p, dirs, arch="llama",
                        extra_tensors=[("direction.x", np.zeros(HIDDEN, np.float32)),
                                       ("direction.7", np.zeros(HIDDEN + 1, np.float32)),
                                       ("direction.8", np.zeros((2, HIDDEN), np.float32))])
    with pytest.raises(VectorFileError) as e:
        load_vector(p)
    msg = str(e.value)
    assert "'llama', expected 'controlvector'" in msg
    assert "'direction.x' is not named direction.K" in msg
    assert "direction.2 holds NaN or inf" in msg
    assert f"direction.7 has {HIDDEN + 1} values but the first direction has {HIDDEN}" in msg
    assert "direction.8 has shape" in msg
    assert isinstance(e.value, SteerFileError)


def test_gguf_f16_and_junk_refused(tmp_path):
    p = tmp_path / "f16.gguf"
    write_llamacpp_gguf(p, _dirs([1]), dtype=np.float16)
    with pytest.raises(VectorFileError, match="direction.1 has type F16, expected F32"):
        load_vector(p)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + struct.pack("<I", 3) + b"\x01\x02")
    with pytest.raises(VectorFileError, match="not a readable GGUF file"):
        load_vector(junk)
    with pytest.raises(VectorFileError, match="no such file"):
        load_vector(tmp_path / "missing.gguf")


def test_gguf_shapes_as_llama_cpp_reads_them(tmp_path):
    """llama.cpp refuses a direction of more than one dimension (``ggml_n_dims``, which does
    not count trailing dimensions of 1): ``[1, hidden]`` is refused, ``[hidden, 1]`` read."""
    p = tmp_path / "shapes.gguf"
    write_llamacpp_gguf(p, {1: _dirs([1])[1][:, None], 2: _dirs([2])[2][None, :]})
    raw = gguf.GGUFReader(str(p))
    assert [list(map(int, t.shape)) for t in raw.tensors] == [[1, HIDDEN], [HIDDEN, 1]]
    with pytest.raises(VectorFileError) as e:
        load_vector(p)
    assert str(e.value).count("has shape") == 1
    assert f"direction.1 has shape [1, {HIDDEN}] (ggml's order), expected one dimension" \
        in str(e.value)
    write_llamacpp_gguf(p, {2: _dirs([2])[2][None, :]})
    assert load_vector(p).layers == [2]


def test_short_or_truncated_gguf_said_so(tmp_path):
    for size in (0, 3):
        p = tmp_path / f"short{size}.gguf"
        p.write_bytes(b"GGU"[:size])
        with pytest.raises(VectorFileError, match=f"file is {size} bytes and does not start "
                                                  "with GGUF's magic 'GGUF': empty, truncated"):
            load_vector(p)
    whole = tmp_path / "whole.gguf"
    write_llamacpp_gguf(whole, _dirs([1, 2]))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole.read_bytes()[:-HIDDEN])
    with pytest.raises(VectorFileError, match="not a readable GGUF file: truncated or corrupt"):
        load_vector(cut)


def test_gguf_keys_kept_and_no_architecture_read_as_llama_cpp_does(tmp_path):
    """Every key of another writer is kept as provenance (EasySteer's method, its floats);
    a file without ``general.architecture`` is read (llama.cpp does not read it)."""
    write_gguf(tmp_path / "es.gguf", [("add_string", "controlvector.model_hint", "qwen2"),
                                      ("add_string", "controlvector.method", "diffmean"),
                                      ("add_uint32", "controlvector.layer_count", 2),
                                      ("add_float32", "controlvector.n_samples", 10.0)],
               _dirs([1, 2]))
    keys = load_vector(tmp_path / "es.gguf").metadata.source["keys"]
    assert keys == {"controlvector.model_hint": "qwen2", "controlvector.method": "diffmean",
                    "controlvector.layer_count": 2, "controlvector.n_samples": 10.0}
    raw = (tmp_path / "es.gguf").read_bytes()
    (tmp_path / "noarch.gguf").write_bytes(raw.replace(b"general.architecture",
                                                       b"general.architectura", 1))
    assert load_vector(tmp_path / "noarch.gguf").layers == [1, 2]



def test_our_gguf_always_has_the_model_hint_other_readers_require(tmp_path):
    """repeng's and EasySteer's ``import_gguf`` refuse a file without
    ``controlvector.model_hint``: it is written even when the architecture is unknown (empty,
    read back here as none, so it refuses no model)."""
    p = tmp_path / "anon.gguf"
    save_gguf(p, make_vector_steer(_dirs([1, 2]), "anon"))
    field = gguf.GGUFReader(str(p)).get_field("controlvector.model_hint")
    assert field is not None and len(field.parts) and field.contents() == ""
    meta = load_vector(p).metadata
    assert meta.model_type is None
    assert model_fit_problems(meta, hidden_size=HIDDEN, num_layers=4, model_type="qwen2") == []

def test_gguf_writer_refuses_block_0(tmp_path):
    vs = make_vector_steer(_dirs([0, 1, 2]), "v0")
    with pytest.raises(VectorFileError, match=r"block 0, which llama.cpp refuses.*--layers 1-2"):
        save_gguf(tmp_path / "v0.gguf", vs)
    assert not (tmp_path / "v0.gguf").exists()
    save_gguf(tmp_path / "v12.gguf", vs.select([1, 2]))  # the fix the message names
    assert load_vector(tmp_path / "v12.gguf").layers == [1, 2]
    save_vector(tmp_path / "v0.safetensors", vs)  # our file steers block 0 too
    assert load_vector(tmp_path / "v0.safetensors").layers == [0, 1, 2]


def test_gguf_carrying_our_metadata_that_is_refused_is_refused_naming_it(tmp_path):
    """A GGUF written here carries our metadata: a document that fails our checks (a newer
    format, a bad label) refuses the file, every reason named, instead of being dropped for
    the file's stem and losing its name, labels and strength unseen."""
    p = tmp_path / "ours.gguf"
    save_gguf(p, make_vector_steer(_dirs([1, 2]), "calm", labels={"harmful": "negative"}))
    assert load_gguf(p).metadata.labels == {"harmful": "negative"}

    def rewrite(doc_text):
        dirs = {int(t.name.split(".")[1]): np.array(t.data)
                for t in gguf.GGUFReader(str(p)).tensors}
        write_gguf(tmp_path / "bad.gguf",
                   [("add_string", "controlvector.model_hint", ""),
                    ("add_string", "controlvector.vllm_steer_metadata", doc_text)], dirs)
        return tmp_path / "bad.gguf"

    doc = json.loads(gguf.GGUFReader(str(p)).get_field(
        "controlvector.vllm_steer_metadata").contents())
    with pytest.raises(VectorFileError) as e:
        load_gguf(rewrite(json.dumps({**doc, "format_version": 99,
                                      "labels": {"harmful": "both"}})))
    msg = str(e.value)
    assert "controlvector.vllm_steer_metadata: " in msg and "format_version" in msg, msg
    assert "harmful" in msg, msg
    with pytest.raises(VectorFileError, match="vllm_steer_metadata is not valid JSON"):
        load_gguf(rewrite("{not json"))
    with pytest.warns(UserWarning, match=r"unknown metadata keys \['future'\]"):
        vs = load_gguf(rewrite(json.dumps({**doc, "future": 1})))
    assert vs.name == "calm" and vs.metadata.extra == {"future": 1}


def test_a_foreign_gguf_is_named_by_its_file_stem(tmp_path):
    p = tmp_path / "detox.v2.gguf"
    write_repeng_gguf(p, _dirs([1, 2]))
    assert load_gguf(p).name == "detox.v2"


def test_a_foreign_ggufs_overlong_hint_or_key_names(tmp_path):
    p = tmp_path / "h.gguf"
    write_repeng_gguf(p, _dirs([1, 2]), model_hint="x" * 200)
    with pytest.raises(VectorFileError, match="controlvector.model_hint is 200 characters"):
        load_gguf(p)
    write_gguf(tmp_path / "k.gguf", [("add_string", "controlvector.model_hint", "llama"),
                                     ("add_string", "k" * 5000, "v"),
                                     ("add_string", "easysteer.method", "diffmean")],
               _dirs([1, 2]))
    vs = load_gguf(tmp_path / "k.gguf")
    assert vs.metadata.source["keys"] == {"controlvector.model_hint": "llama",
                                          "easysteer.method": "diffmean"}
    save_vector(tmp_path / "k.safetensors", vs)  # its provenance is a file we can write


def test_vectors_beyond_float32_and_oversized_metadata_are_refused(tmp_path):
    """An F64 vector file is read as float32: values it cannot hold are refused, not read as
    inf; and the writer refuses metadata the reader would refuse, so a file it writes is one
    it reads."""
    from safetensors.torch import save_file

    vs = make_vector_steer(_dirs([1, 2]), "v")
    big = {f"direction.{k}": v.double() for k, v in vs.directions.items()}
    big["direction.2"][3] = -1e300
    save_file(big, tmp_path / "big.safetensors",
              metadata={"vllm_steer": vs.metadata.to_json(), "format": "pt"})
    with pytest.raises(VectorFileError, match="direction.2' holds values up to 1e\\+300, "
                                              "beyond torch.float32's range"):
        load_vector(tmp_path / "big.safetensors")
    fat = make_vector_steer(_dirs([1, 2]), "v", recipe={"notes": "x" * (300 << 10)})
    with pytest.raises(VectorFileError, match="at most 262144 bytes"):
        save_vector(tmp_path / "fat.safetensors", fat)
    assert not (tmp_path / "fat.safetensors").exists()


def _rewrite_meta(path, edit):
    """Rewrite the JSON metadata of a safetensors file in place (same tensors)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    doc = json.loads(header["__metadata__"]["vllm_steer"])
    edit(doc)
    header["__metadata__"]["vllm_steer"] = json.dumps(doc)
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    path.write_bytes(struct.pack("<Q", len(hb)) + hb + raw[8 + n:])


def test_our_vector_file_refusals_listed_at_once(tmp_path):
    p = tmp_path / "v.safetensors"
    save_vector(p, make_vector_steer(_dirs([1, 2]), "v", labels={"harmful": "negative"},
                                     model_layers=4, recommended_strength=2.0))
    meta = read_vector_metadata(p)
    assert meta.layers == [1, 2] and meta.model_layers == 4 and meta.recommended_strength == 2.0

    def edit(d):
        d["layers"] = [1, 3]
        d["labels"] = {"harmful": "both"}
        d["recommended_strength"] = float("inf")
    _rewrite_meta(p, edit)
    with pytest.raises(VectorFileError) as e:
        load_vector(p)
    msg = str(e.value)
    assert "labels.harmful='both'" in msg and "recommended_strength=inf" in msg
    # the tensors are compared with the layers in the same error
    assert "tensors are for blocks 1-2 but the metadata lists 1,3" in msg
    _rewrite_meta(p, lambda d: (d.pop("layers"), d.update(hidden_size=HIDDEN + 1)))
    with pytest.raises(VectorFileError) as e:
        load_vector(p)
    msg = str(e.value)
    assert "lacks required keys ['layers']" in msg and "layers=" not in msg  # said once
    assert f"direction.1 has shape [{HIDDEN}] but the metadata's hidden size is {HIDDEN + 1}" \
        in msg
    _rewrite_meta(p, lambda d: d.update(layers=[1, 3], hidden_size=HIDDEN))
    _rewrite_meta(p, lambda d: d.update(labels={}, recommended_strength=None, model_layers=3))
    with pytest.raises(VectorFileError, match=r"layers include block 3 but model_layers=3"):
        load_vector(p)
    _rewrite_meta(p, lambda d: d.update(model_layers=None))
    with pytest.raises(VectorFileError, match=r"tensors are for blocks 1-2 but the metadata "
                                              r"lists 1,3"):
        load_vector(p)


def test_kinds_do_not_mix(tmp_path):
    vec = tmp_path / "v.safetensors"
    save_vector(vec, make_vector_steer(_dirs([1]), "v"))
    gg = tmp_path / "v.gguf"
    write_repeng_gguf(gg, _dirs([1]))
    for read in (read_metadata, load_steer):
        with pytest.raises(SteerFileError, match="this is a vector steer"):
            read(vec)
        with pytest.raises(SteerFileError, match="this is a GGUF file .*load_vector"):
            read(gg)
    lm = tmp_path / "lm.safetensors"
    save_steer(lm, make_steer(torch.ones(HIDDEN, 2), torch.ones(HIDDEN, 2), "lm"))
    raw = lm.read_bytes()
    assert b'"kind"' not in raw  # LM-Steer files are written as before kinds existed
    with pytest.raises(VectorFileError, match="kind='lm-steer', expected 'vector'"):
        load_vector(lm)
    _rewrite_meta(lm, lambda d: d.update(kind="lm-steer"))
    assert read_metadata(lm).name == "lm"  # an explicit default kind is accepted
    _rewrite_meta(lm, lambda d: d.update(kind="sae"))
    with pytest.raises(SteerFileError, match="kind='sae', expected one of 'lm-steer', 'vector'"):
        read_metadata(lm)


def test_fit_against_model_names_both_sides():
    vs = make_vector_steer(_dirs(range(1, 6)), "v", base_model="org/Model-A",
                           model_type="llama", model_layers=6)
    m = vs.metadata
    assert model_fit_problems(m, hidden_size=HIDDEN, num_layers=6, model_name="/x/model-a",
                              model_type="llama") == []
    reasons = model_fit_problems(m, hidden_size=32, num_layers=4, model_name="org/other",
                                 model_type="gpt2")
    text = "\n".join(reasons)
    assert f"hidden size {HIDDEN} but 'org/other' has hidden size 32" in text
    assert "vectors for blocks 4-5 but 'org/other' has 4 decoder blocks (0 to 3)" in text
    assert "made for a model of 6 decoder blocks but 'org/other' has 4" in text
    assert "made for a 'llama' model but 'org/other' is a 'gpt2' model" in text
    assert "made for 'org/Model-A' but the model is 'org/other'" in text
    with pytest.raises(VectorFileError, match="calm.gguf"):
        check_fits_model(m, "calm.gguf", hidden_size=32, num_layers=6)



@pytest.mark.parametrize("hint, served", [
    ("llama", "mistral"), ("llama", "mixtral"), ("command-r", "cohere"), ("phi2", "phi"),
    ("starcoder", "gpt_bigcode"), ("deepseek2", "deepseek_v3"), ("gemma3", "gemma3_text"),
    ("qwen2moe", "qwen2_moe"), ("gptneox", "gpt_neox"), ("LLaMA", "llama"),
    ("granitehybrid", "granitemoehybrid"), ("hunyuan-moe", "hunyuan_v1_moe"),
    ("hunyuan-dense", "hunyuan_v1_dense"), ("nemotron_h_moe", "nemotron_h"),
    ("deci", "nemotron-nas"), ("llama", "internlm3"), ("qwen2vl", "qwen2_5_vl_text"),
    ("qwen2vl", "qwen2_vl_text")])
def test_llama_cpps_architecture_names_fit_the_models_they_convert(tmp_path, hint, served):
    """llama.cpp's ``cvector-generator`` writes its own architecture name as the model hint
    (a Mistral model's vectors say ``llama``): a file made from a Mistral GGUF fits Mistral;
    the served config's ``model_type`` may be a text config's (``gemma3_text``)."""
    p = tmp_path / "cv.gguf"
    write_repeng_gguf(p, _dirs(range(1, 6)), model_hint=hint)
    meta = load_gguf(p).metadata
    assert meta.model_type == hint
    assert model_fit_problems(meta, hidden_size=HIDDEN, num_layers=6, model_type=served) == []


#: ``model_type`` of configs that ship as remote code, not in transformers.
REMOTE_CODE_MODEL_TYPES = {"nemotron-nas", "internlm3"}


def test_the_aliases_name_llama_cpps_architectures_and_real_model_types():
    """Each alias is read from the two projects: its key one of llama.cpp's architecture
    names (the ``gguf`` package's table), its values ``model_type`` s of transformers'
    configs (or of a known remote-code config)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from vllm_steer.vectors import LLAMA_CPP_ARCH_MODEL_TYPES

    arches = set(gguf.MODEL_ARCH_NAMES.values())
    for arch, types in LLAMA_CPP_ARCH_MODEL_TYPES.items():
        assert arch in arches, arch
        for t in types:
            assert t in CONFIG_MAPPING_NAMES or t in REMOTE_CODE_MODEL_TYPES, (arch, t)


def test_a_short_base_model_name_fits_the_served_hub_id_in_any_case():
    """The shipped smollm2 vector steer says ``base_model: smollm2``: it fits the model served
    by its Hugging Face id or a local copy's path, whatever their case."""
    meta = make_vector_steer(_dirs(range(1, 6)), "v", base_model="smollm2").metadata
    for served in ("HuggingFaceTB/SmolLM2-135M-Instruct", "/models/SMOLLM2-135M", "smollm2"):
        assert model_fit_problems(meta, hidden_size=HIDDEN, num_layers=6,
                                  model_name=served) == [], served
    assert model_fit_problems(meta, hidden_size=HIDDEN, num_layers=6,
                              model_name="Qwen/Qwen3-0.6B") == [
        "the steer was made for 'smollm2' but the model is 'Qwen/Qwen3-0.6B'"]


@pytest.mark.parametrize("hint, served", [("llama", "qwen2"), ("mistral", "llama"),
                                          ("command-r", "cohere2"), ("phi2", "phi3"),
                                          ("gemma3", "gemma2")])
def test_other_architectures_are_still_refused(hint, served):
    """The aliases are llama.cpp's names for the architectures it converts, read one way: a
    file's ``llama`` fits a served Mistral, but a file made on Mistral does not fit a served
    Llama (the served ``model_type`` is always the Hugging Face config's)."""
    meta = make_vector_steer(_dirs(range(1, 6)), "v", model_type=hint).metadata
    reasons = model_fit_problems(meta, hidden_size=HIDDEN, num_layers=6, model_type=served)
    assert reasons == [f"the steer was made for a {hint!r} model but the model is a "
                       f"{served!r} model"]


def test_parse_layers():
    assert parse_layers("1-3,7") == [1, 2, 3, 7]
    assert parse_layers("all", 3) == [0, 1, 2]
    with pytest.raises(ValueError, match="block 5 does not exist; the model has 4"):
        parse_layers("2-5", 4)
    with pytest.raises(ValueError, match="like 1-29"):
        parse_layers("3-1")
    for spec in ("5-", "-5", "1,,2", "", "a-b"):  # a missing end is not block 5 alone
        with pytest.raises(ValueError, match="like 1-29"):
            parse_layers(spec, 30)
    # refused at once, before any range is built (no seconds, no memory)
    with pytest.raises(ValueError, match="block 30000000 does not exist; the model has 30"):
        parse_layers("1-30000000", 30)
    with pytest.raises(ValueError, match=f"names blocks 0 to {MAX_LAYERS - 1}"):
        parse_layers("0-99999")


def test_reference_against_a_loop():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(5, HIDDEN, generator=g).to(torch.bfloat16)
    vecs = torch.randn(3, HIDDEN, generator=g)
    coefs = torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.5, -2.0, 0.0],
                          [0.0, 0.0, 3.0], [1.0, 1.0, 1.0]])
    out = vector_steer_reference(h, vecs, coefs)
    assert out.dtype == h.dtype
    assert torch.equal(out[0], h[0])  # an unsteered row: bit-identical
    for r in range(1, 5):
        want = h[r].double() + sum(float(coefs[r, i]) * vecs[i].double() for i in range(3))
        torch.testing.assert_close(out[r], want.to(torch.bfloat16), rtol=0, atol=0)


def _llama(layers=3, bigram=False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=97,
                      max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).eval()
    if bigram:  # every block adds nothing to the residual stream
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
    return model


def _inputs_of(modules, run):
    """What each module receives (its first argument) during ``run()``."""
    seen = {}
    hooks = [m.register_forward_pre_hook(
        lambda _m, args, kwargs, i=i: seen.__setitem__(
            i, args[0] if args else kwargs["hidden_states"]), with_kwargs=True)
        for i, m in enumerate(modules)]
    try:
        out = run()
    finally:
        for h in hooks:
            h.remove()
    return seen, out


def test_vector_is_added_to_block_k_output_as_transformers_numbers_it():
    """With ``direction.K`` at strength ``a``, what block K+1 (or the final norm, after the
    last block) receives is the unsteered output of block K plus ``a * v`` -- transformers'
    ``hidden_states[K + 1]`` -- and nothing before block K changes."""
    model = _llama(layers=4)
    ids = torch.tensor([[5, 9, 2, 44, 7]])
    v = torch.randn(32)
    nxt = [*model.model.layers[1:], model.model.norm]
    run = lambda: model(ids, output_hidden_states=True).hidden_states  # noqa: E731
    with torch.no_grad():
        plain_in, plain = _inputs_of(nxt, run)
        for k in range(3):  # the off-by-one: hidden_states[k + 1] is block k's output
            torch.testing.assert_close(plain_in[k], plain[k + 1], rtol=0, atol=0)
        for k in range(4):
            with vector_steering(model, make_vector_steer({k: v}, "v"), 1.5):
                got_in, got = _inputs_of(nxt, run)
            for j in range(k + 1):
                assert torch.equal(got[j], plain[j])
            torch.testing.assert_close(got_in[k], plain_in[k] + 1.5 * v, rtol=1e-6, atol=1e-6)
            assert not torch.allclose(got[-1], plain[-1], atol=1e-3)
    assert decoder_layers(model) is model.model.layers


def test_logits_move_as_a_hand_written_forward_says():
    """On a model whose blocks add nothing, the head's input is ``norm(embed(t) + sum a_i v_i)``
    for vectors on any blocks: the logits computed by hand from the weights."""
    model = _llama(layers=3, bigram=True)
    ids = torch.tensor([[3, 17, 60, 8]])
    emb = model.model.embed_tokens.weight[ids[0]]
    g = torch.Generator().manual_seed(1)
    a = make_vector_steer({1: torch.randn(32, generator=g), 2: torch.randn(32, generator=g)}, "a")
    b = make_vector_steer({2: torch.randn(32, generator=g)}, "b")
    eps, w_norm = model.config.rms_norm_eps, model.model.norm.weight

    def by_hand(x):
        x = x.double()
        normed = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w_norm.double()
        return normed @ model.lm_head.weight.double().T

    shift = 2.0 * (a.directions[1] + a.directions[2]) - 3.0 * b.directions[2]
    with torch.no_grad(), vector_steering(model, {"a": a, "b": b}, {"a": 2.0, "b": -3.0}):
        got = model(ids).logits[0]
    with torch.no_grad():
        plain = model(ids).logits[0]
    torch.testing.assert_close(got.double(), by_hand(emb + shift), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(plain.double(), by_hand(emb), rtol=1e-4, atol=1e-4)
    assert (got - plain).abs().max() > 0.1  # the steer moved the logits


def test_vector_steering_refuses_a_misfit(tmp_path):
    model = _llama(layers=3)
    with pytest.raises(ValueError, match=r"hidden size 16 but the model has hidden size 32"):
        with vector_steering(model, make_vector_steer(_dirs([1]), "v"), 1.0):
            pass
    with pytest.raises(ValueError, match=r"blocks 3 but the model has 3 decoder blocks"):
        with vector_steering(model, make_vector_steer(_dirs([3], hidden=32), "v"), 1.0):
            pass


@pytest.mark.parametrize("kind", ["gguf", "safetensors"])
def test_mutated_files_load_or_are_refused(tmp_path, kind):
    """Bit flips, truncations and byte insertions: the outcome is always a sound vector steer
    or a VectorFileError, never another exception."""
    import random
    import warnings

    src = tmp_path / f"v.{kind}"
    vs = make_vector_steer(_dirs([1, 2, 3]), "v", model_type="llama")
    (save_gguf if kind == "gguf" else save_vector)(src, vs)
    raw = src.read_bytes()
    rng = random.Random(0)
    outcomes = {"loaded": 0, "refused": 0}
    for i in range(150):
        b = bytearray(raw)
        op = i % 3
        if op == 0:
            for _ in range(rng.randint(1, 4)):
                b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        elif op == 1:
            b = b[:rng.randrange(len(b))]
        else:
            at = rng.randrange(len(b))
            b[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        p = tmp_path / f"m{i}.{kind}"
        p.write_bytes(bytes(b))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                got = load_vector(p)
        except VectorFileError:
            outcomes["refused"] += 1
            continue
        outcomes["loaded"] += 1
        assert all(v.shape == (got.hidden_size,) and torch.isfinite(v).all()
                   for v in got.directions.values())
        assert sorted(got.directions) == got.metadata.layers
    assert outcomes["refused"] > 50


@pytest.mark.parametrize("save", [save_vector, save_gguf, "steer"])
def test_writers_refuse_a_path_that_cannot_be_a_file_and_leave_nothing(tmp_path, save):
    """Every writer refuses a directory (or a name ending in /) and a path below a file,
    naming the path, before writing: no ``OUT.tmp`` or ``OUT/.tmp`` is left behind."""
    from vllm_steer.format import OutputPathError

    if save == "steer":
        def save(p, _):
            save_steer(p, make_steer(torch.randn(HIDDEN, 2), torch.randn(HIDDEN, 2), "s"))
    vs = make_vector_steer(_dirs([1, 2]), "v")
    (tmp_path / "d").mkdir()
    (tmp_path / "f").write_text("x")
    for out, says in ((tmp_path / "d", "is a directory, not a file"),
                      (f"{tmp_path / 'd'}/", "is a directory, not a file"),
                      (tmp_path / "f" / "x.bin", f"{tmp_path / 'f'} is not a directory")):
        with pytest.raises(OutputPathError, match=f"{str(out)!r}.*{says}|{says}") as e:
            save(out, vs)
        assert str(out) in str(e.value)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["d", "f"]
    assert (tmp_path / "f").read_text() == "x"


def test_a_hub_cache_snapshot_folder_is_its_model():
    # `vllm serve /root/.cache/huggingface/hub/models--ORG--NAME/snapshots/REV` (offline
    # serving) serves the very model a steer made for ORG/NAME names
    from vllm_steer.vectors import VectorMetadata

    meta = VectorMetadata(name="calm", hidden_size=HIDDEN, layers=[1], model_layers=4,
                          base_model="meta-llama/Llama-3.1-8B-Instruct", model_type="llama")
    snap = ("/root/.cache/huggingface/hub/models--meta-llama--Llama-3.1-8B-Instruct/snapshots/"
            "0e9e39f249a16976918f6564b8830bc894c89659")
    assert model_fit_problems(meta, hidden_size=HIDDEN, num_layers=4, model_name=snap,
                              model_type="llama") == []
    other = snap.replace("Llama-3.1-8B-Instruct", "Mistral-7B-v0.1")
    assert model_fit_problems(meta, hidden_size=HIDDEN, num_layers=4, model_name=other,
                              model_type="llama")


def test_a_model_served_from_a_folder_fits_by_its_served_model_name():
    # `vllm serve /models/llama8b --served-model-name meta-llama/Llama-3.1-8B-Instruct` (the
    # chart's way: the model's folder on a claim) serves the model the steer names
    from types import SimpleNamespace

    from vllm_steer.integrations.families import model_identity
    from vllm_steer.vectors import VectorMetadata

    meta = VectorMetadata(name="calm", hidden_size=HIDDEN, layers=[1], model_layers=4,
                          base_model="meta-llama/Llama-3.1-8B-Instruct", model_type="llama")
    hf = SimpleNamespace(hidden_size=HIDDEN, num_hidden_layers=4, model_type="llama")
    mc = SimpleNamespace(model="/models/llama8b", served_model_name=["chat", "meta-llama/"
                         "Llama-3.1-8B-Instruct"], hf_config=hf, hf_text_config=hf,
                         get_hidden_size=lambda: HIDDEN, get_num_layers=lambda *a: 4)
    assert model_fit_problems(meta, **model_identity(mc)) == []
    mc.served_model_name = "chat"
    [why] = model_fit_problems(meta, **model_identity(mc))
    assert why == ("the steer was made for 'meta-llama/Llama-3.1-8B-Instruct' but the model is "
                   "'/models/llama8b' (served as 'chat')")


def test_a_model_gguf_is_refused_in_a_few_lines(tmp_path):
    # a model's GGUF given as a control vector: its hundreds of tensors are one reason
    p = tmp_path / "model.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    for i in range(100):
        for n in ("attn_q", "attn_k", "ffn_up"):
            w.add_tensor(f"blk.{i}.{n}.weight", np.zeros((4, 4), np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(VectorFileError) as e:
        load_vector(p)
    assert "'llama', expected 'controlvector'" in str(e.value)
    assert len(e.value.reasons) <= 3 and len(str(e.value)) < 2000
    assert "300 tensors ('blk.0.attn_q.weight'" in str(e.value) and "and 295 more" in str(e.value)


def test_one_vector_for_several_blocks_is_saved(tmp_path):
    # the same direction at several blocks: make_vector_steer keeps one tensor for all of them
    v = torch.randn(HIDDEN)
    vs = make_vector_steer({k: v for k in (2, 3, 4)}, "same")
    save_vector(tmp_path / "s.safetensors", vs)
    back = load_vector(tmp_path / "s.safetensors")
    assert back.layers == [2, 3, 4]
    assert all(torch.equal(back.directions[k], v) for k in (2, 3, 4))
