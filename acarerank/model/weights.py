"""Qwen3 weights in the layout the runner computes with.

Per layer, q/k/v projections are concatenated into one [(Hq+2·Hkv)·d, H] matrix and
gate/up into one [2·I, H] matrix: one GEMM each instead of three and two, which is what
matters on CPU. (So ``from_hf`` holds a copy of those matrices beside the HF model.)
"""
from __future__ import annotations

import glob
import json
import os
import warnings
from dataclasses import dataclass
from typing import Optional

import torch

from .._validate import check_file_size
from .arch import Qwen3Arch
from .score_labels import yes_no_rows
from .stored_names import refuse_foreign, warn_unused


@dataclass
class LayerWeights:
    input_norm: torch.Tensor      # [H]
    w_qkv: torch.Tensor           # [(Hq + 2·Hkv)·d, H]
    b_qkv: Optional[torch.Tensor]  # [(Hq + 2·Hkv)·d] when attention_bias
    q_norm: torch.Tensor          # [d]
    k_norm: torch.Tensor          # [d]
    w_o: torch.Tensor             # [H, Hq·d]
    post_norm: torch.Tensor       # [H]
    w_gate_up: torch.Tensor       # [2·I, H]
    w_down: torch.Tensor          # [H, I]
    b_o: Optional[torch.Tensor] = None  # [H] when attention_bias: transformers' Qwen3 gives o_proj a bias too


#: bytes of config.json (and of model.safetensors.index.json) read with json, which holds the whole
#: file and every object in it in memory: Qwen3's config.json is ~1 kB, a 36-layer index ~30 kB,
#: so 16 MiB only refuses a file that is not a config (docs/input-safety.md)
MAX_CONFIG_BYTES = 16 * 1024 * 1024


class CheckpointError(ValueError):
    """A checkpoint folder (or in-memory model) cannot be used as is; the message names the
    file and the tensor. A ValueError, so callers treating bad input as ValueError catch it."""


@dataclass
class Qwen3Weights:
    arch: Qwen3Arch
    embed: torch.Tensor           # [V, H]
    layers: list
    final_norm: torch.Tensor      # [H]
    lm_head: Optional[torch.Tensor]  # [V, H] (the embedding itself when tied); None for a score-head model
    # [1, H] the yes−no direction, or [2, H] the [no, yes] rows: Qwen3ForSequenceClassification's
    # score.weight with its rows put in that order by the config's id2label (score_labels)
    score_head: Optional[torch.Tensor] = None
    # a score-head model's config pad_token_id: transformers' Qwen3ForSequenceClassification scores
    # the last token that is not this id (None for a causal LM)
    score_pad_token_id: Optional[int] = None

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device


def _expected_shapes(arch: Qwen3Arch) -> dict:
    """Suffix of a tensor name -> (its shape, the config fields behind each dimension) (HF layout,
    [out, in] for linear weights)."""
    H, I, d, V = arch.hidden_size, arch.intermediate_size, arch.head_dim, arch.vocab_size
    q, kv = arch.num_heads * d, arch.num_kv_heads * d
    h, i, v = f"hidden_size {H}", f"intermediate_size {I}", f"vocab_size {V}"
    hq = f"num_attention_heads {arch.num_heads} × head_dim {d}"
    hkv = f"num_key_value_heads {arch.num_kv_heads} × head_dim {d}"
    return {"input_layernorm.weight": ((H,), [h]), "post_attention_layernorm.weight": ((H,), [h]),
            "self_attn.q_proj.weight": ((q, H), [hq, h]), "self_attn.k_proj.weight": ((kv, H), [hkv, h]),
            "self_attn.v_proj.weight": ((kv, H), [hkv, h]), "self_attn.q_proj.bias": ((q,), [hq]),
            "self_attn.k_proj.bias": ((kv,), [hkv]), "self_attn.v_proj.bias": ((kv,), [hkv]),
            "self_attn.o_proj.bias": ((H,), [h]), "self_attn.q_norm.weight": ((d,), [f"head_dim {d}"]),
            "self_attn.k_norm.weight": ((d,), [f"head_dim {d}"]), "self_attn.o_proj.weight": ((H, q), [h, hq]),
            "mlp.gate_proj.weight": ((I, H), [i, h]), "mlp.up_proj.weight": ((I, H), [i, h]),
            "mlp.down_proj.weight": ((H, I), [h, i]), "model.embed_tokens.weight": ((V, H), [v, h]),
            "lm_head.weight": ((V, H), [v, h]), "model.norm.weight": ((H,), [h])}


_FLOAT_WEIGHTS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

#: the transformers classes whose stored tensors the loader reads as their class means them
READ_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3ForSequenceClassification")
#: Qwen3 classes whose head the loader would misread, and why each is refused
MISREAD_ARCHITECTURES = {
    "Qwen3ForTokenClassification": "its score head (with a bias) labels every token for a tagging task; read as a "
                                   "reranker's yes/no head it would give scores with no meaning",
    "Qwen3ForQuestionAnswering": "its qa_outputs head gives answer-span start/end logits, not yes/no, and it has no "
                                 "language-model head",
}


def _architectures_note(names, place: str, error=None) -> Optional[str]:
    """The check of a checkpoint's declared classes (config.json's ``architectures``; an in-memory
    model's class and its bases): CheckpointError for a Qwen3 head the loader would misread
    (``MISREAD_ARCHITECTURES``); None when a class is one the loader reads (or none is named);
    else a sentence naming them, for the warning given when the tensors still read as a Qwen3
    model (transformers' Auto classes pick the class by model_type, not by this list) and for the
    error when they do not."""
    if names is None:
        return None
    if isinstance(names, str) or not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise CheckpointError(f"{place}: 'architectures' must be a list of class names, got {names!r}")
    misread = [n for n in names if n in MISREAD_ARCHITECTURES]
    if misread:
        raise CheckpointError(f"{place}: architectures names {misread[0]!r}, which is not supported: "
                              f"{MISREAD_ARCHITECTURES[misread[0]]}. acarerank reads a Qwen3ForCausalLM or a "
                              f"Qwen3ForSequenceClassification yes/no reranker")
    if not names or any(n in READ_ARCHITECTURES for n in names):
        return None
    if "Qwen3Model" in names:
        return f"{place}: architectures names 'Qwen3Model', a Qwen3 decoder without an output head"
    return (f"{place}: architectures names {list(names)}, not a class acarerank reads "
            f"({', '.join(READ_ARCHITECTURES)})")


def _warn_declared_head_differs(names, has_score_head: bool, place: str) -> None:
    """Warn when the declared classes name only the head the tensors do not carry: a
    Qwen3ForCausalLM config over a ``score.weight`` and no ``lm_head`` (transformers' class would
    drop the score head and put the tied embedding in its place), or a
    Qwen3ForSequenceClassification config over an ``lm_head`` (it would start a random score
    head). The loader reads what the tensors are; the scores then differ from that class's."""
    declared = [n for n in (names or ()) if n in READ_ARCHITECTURES]
    read = READ_ARCHITECTURES[1] if has_score_head else READ_ARCHITECTURES[0]
    if declared and read not in declared:
        tensors = "a score.weight head" if has_score_head else "an lm_head and no score.weight"
        warnings.warn(f"{place}: architectures names {declared} but the tensors carry {tensors}: read as a {read} "
                      f"(what the tensors are); transformers' {declared[0]} would read them otherwise (its scores "
                      "would differ) — check that this is the model you meant", stacklevel=4)


def _from_state_dict(arch: Qwen3Arch, sd, dtype, device, source: str = "the model", id2label=None,
                     config_source: str = "the config", label2id=None, architectures=None,
                     architectures_source: Optional[str] = None, pad_token_id=None) -> Qwen3Weights:
    """Build the runner's layout from a name -> tensor mapping (``sd.where(name)``, if present,
    names the file a tensor lives in). Every error is a CheckpointError naming ``source``/the file
    and the tensor. ``id2label`` (and ``label2id``, checked against it): the config's, naming
    ``score.weight``'s rows (score_labels). ``architectures``: the declared class names
    (``_architectures_note``; named as ``architectures_source``, else ``config_source``).
    ``pad_token_id``: the config's, kept for a score-head model (``score_pad_token_id``).
    Stored tensors the model does not read: ``stored_names``."""
    note = _architectures_note(architectures, architectures_source or config_source)
    shapes = _expected_shapes(arch)
    where = getattr(sd, "where", lambda name: source)
    names = list(sd.keys())
    refuse_foreign(names, arch.num_layers, source, CheckpointError)
    used = set()

    def take(name):
        if name not in sd:
            raise CheckpointError(f"{source}: no tensor {name!r} (a missing shard, or not a Qwen3 checkpoint)"
                                  + (f"; {note}" if note else ""))
        used.add(name)
        t = sd[name]
        want, why = shapes.get(name) or shapes.get(name.split(".", 3)[-1]) or (None, [])
        if want is not None and tuple(t.shape) != want:
            raise CheckpointError(f"{where(name)}: tensor {name!r} has shape {tuple(t.shape)}, the config implies "
                                  f"{list(want)} ({', '.join(why)})"
                                  + arch.default_note(*(k for k in arch.defaulted if any(k in w for w in why))))
        out = floating(t, name, where(name)).to(device=device, dtype=dtype)
        check_finite_weight(out, name, where(name), stored=t)
        return out

    def floating(t, name, place):
        # int8 / fp8 / bool weights are quantized (their scales live in other tensors): cast as
        # they are, they once gave scores with no meaning and no error
        if t.dtype not in _FLOAT_WEIGHTS:
            raise CheckpointError(f"{place}: tensor {name!r} is {str(t.dtype).replace('torch.', '')}; only float32, "
                                  "bfloat16, float16 (or float64) weights are read — a quantized checkpoint is not "
                                  "supported")
        return t

    layers = []
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        b_qkv = b_o = None
        if arch.attention_bias:
            b_qkv = torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
            b_o = take(p + "self_attn.o_proj.bias")
        layers.append(LayerWeights(
            input_norm=take(p + "input_layernorm.weight"),
            w_qkv=torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"]),
            b_qkv=b_qkv,
            q_norm=take(p + "self_attn.q_norm.weight"),
            k_norm=take(p + "self_attn.k_norm.weight"),
            w_o=take(p + "self_attn.o_proj.weight"),
            post_norm=take(p + "post_attention_layernorm.weight"),
            w_gate_up=torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]),
            w_down=take(p + "mlp.down_proj.weight"),
            b_o=b_o,
        ))
    embed = take("model.embed_tokens.weight")
    lm_head, score_head = None, None
    if "score.weight" in sd:
        if "lm_head.weight" in sd:
            raise CheckpointError(f"{source}: has both lm_head.weight and score.weight; cannot tell whether it is a "
                                  "causal LM or a sequence-classification reranker")
        score_head = sd["score.weight"]
        if score_head.dim() != 2 or score_head.shape[0] not in (1, 2) or score_head.shape[1] != arch.hidden_size:
            raise CheckpointError(
                f"{where('score.weight')}: a Qwen3ForSequenceClassification head score.weight of shape "
                f"{tuple(score_head.shape)}; a yes/no reranker head has 1 row (the yes−no direction) or 2 rows "
                f"(no and yes, as id2label names them) of hidden size {arch.hidden_size}")
        try:
            rows = yes_no_rows(id2label, score_head.shape[0], label2id)
        except ValueError as e:
            raise CheckpointError(f"{config_source}: {e}") from None
        used.add("score.weight")
        stored = floating(score_head, "score.weight", where("score.weight"))[rows]
        score_head = stored.to(device=device, dtype=dtype)
        check_finite_weight(score_head, "score.weight", where("score.weight"), stored=stored)
    elif "lm_head.weight" in sd:
        lm_head = take("lm_head.weight")
        if arch.tie_word_embeddings:
            if torch.equal(lm_head, embed):
                lm_head = embed  # one copy of the [V, H] matrix
            else:  # transformers (>= 5) then keeps both untied; reading the embedding would score differently
                warnings.warn(f"{where('lm_head.weight')}: tie_word_embeddings is true but 'lm_head.weight' differs "
                              "from the embedding; using lm_head.weight, as transformers does", stacklevel=3)
    elif arch.tie_word_embeddings:
        lm_head = embed
    else:
        raise CheckpointError(f"{source}: tie_word_embeddings is false but there is no tensor 'lm_head.weight' (nor a "
                              "sequence-classification 'score.weight'); the output layer is missing — a lost shard? "
                              "(it is never replaced by the embedding)" + (f"; {note}" if note else ""))
    final_norm = take("model.norm.weight")
    _warn_declared_head_differs(architectures, score_head is not None, architectures_source or config_source)
    if note:  # every tensor a Qwen3 model reads is there: read as transformers' Auto classes would
        read_as = ("Qwen3ForSequenceClassification (score.weight)" if score_head is not None else
                   "Qwen3ForCausalLM" + (" with the tied embedding as its output layer" if lm_head is embed else ""))
        warnings.warn(f"{note}; its tensors are read as a {read_as}, as transformers reads a model_type qwen3 "
                      "checkpoint — check that this is the model you meant", stacklevel=3)
    warn_unused(names, used, source, stacklevel=3)
    pad = pad_token_id if isinstance(pad_token_id, int) and not isinstance(pad_token_id, bool) else None
    return Qwen3Weights(arch=arch, embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head,
                        score_head=score_head, score_pad_token_id=pad if score_head is not None else None)


def check_finite_weight(t: torch.Tensor, name: str, place: str, stored: torch.Tensor) -> None:
    """CheckpointError if ``t`` (a weight as the runner will compute with it, cast from ``stored``)
    holds NaN/inf.

    A NaN/inf weight gives NaN/inf scores or tokens picked from NaN logits (its own documents or
    every one, as it sits in a layer or in the output layer); an fp32 weight past float16's range
    becomes inf when loaded as float16. ``aminmax`` propagates NaN and reads each element once:
    all weights of the Qwen3-Reranker-0.6B shape in bf16 (595.8 M values) take 0.11 s on one thread
    of a 2-core x86, against 2.3 s for loading that folder (docs/input-safety.md).
    """
    if t.numel() == 0:
        return
    lo, hi = torch.aminmax(t)
    if bool(torch.isfinite(lo)) and bool(torch.isfinite(hi)):
        return
    bad = ~torch.isfinite(t)
    n = int(bad.sum())
    first = [int(i) for i in bad.nonzero()[0].tolist()]
    kinds = [k for k, m in (("NaN", torch.isnan(t)), ("inf", torch.isinf(t))) if bool(m.any())]
    cast = (f" after the cast from {str(stored.dtype).replace('torch.', '')} to {str(t.dtype).replace('torch.', '')} "
            f"(the stored values are finite but beyond its range: load in float32 or bfloat16)"
            if stored.dtype != t.dtype and bool(torch.isfinite(stored).all()) else "")
    raise CheckpointError(f"{place}: tensor {name!r} holds {' and '.join(kinds)} in {n} of {t.numel()} values "
                          f"(first at index {first}){cast}; a model with non-finite weights gives NaN scores or "
                          f"tokens chosen from NaN logits, so it is not loaded")


#: a causal-LM or classifier's own tensors, beside the decoder's (``model.``) ones
HEAD_NAMES = ("lm_head.weight", "score.weight")


def causal_lm_names(names: dict) -> dict:
    """``names`` (tensor name -> anything) of a bare Qwen3Model (``embed_tokens.weight``, no
    ``model.`` prefix) under Qwen3ForCausalLM's names, as transformers' from_pretrained reads them:
    the decoder's prefixed, a head stored beside it kept. Prefixed too, ``lm_head.weight`` became
    ``model.lm_head.weight``, unread: a tied config then scored with the embedding as its head
    and only an "unused tensor" warning, an untied one said there was no lm_head. Else as given."""
    if "embed_tokens.weight" not in names or "model.embed_tokens.weight" in names:
        return names
    return {(k if k in HEAD_NAMES else "model." + k): v for k, v in names.items()}


def weights_from_hf(model) -> Qwen3Weights:
    """From an in-memory ``transformers`` Qwen3ForCausalLM or Qwen3ForSequenceClassification (its dtype and device)."""
    if not hasattr(model, "config") or not hasattr(model, "state_dict"):
        raise TypeError(f"expected a transformers Qwen3ForCausalLM, got {type(model).__name__}")
    arch = Qwen3Arch.from_config(model.config)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    sd = causal_lm_names(sd)   # a bare Qwen3Model's
    if not sd:
        raise CheckpointError(f"{type(model).__name__} has no parameters")
    p = next(iter(sd.values()))
    # the class that runs in transformers (and its bases: a subclass of Qwen3ForCausalLM is read as one)
    classes = [c.__name__ for c in type(model).__mro__]
    return _from_state_dict(arch, sd, p.dtype, p.device, source=f"in-memory {type(model).__name__}",
                            id2label=getattr(model.config, "id2label", None), config_source="the model's config",
                            label2id=getattr(model.config, "label2id", None),
                            pad_token_id=getattr(model.config, "pad_token_id", None),
                            architectures=[c for c in classes if c.startswith("Qwen3")] or None,
                            architectures_source=f"in-memory {type(model).__name__}")


class _LazyTensors:
    """name -> tensor over open safetensors files, read on access; ``where(name)`` is its file."""

    def __init__(self, handles: dict, location: dict, raw: dict):
        self._handles, self._location, self._raw = handles, location, raw  # raw: the name inside the file

    def __contains__(self, name) -> bool:
        return name in self._location

    def keys(self):
        return self._location.keys()

    def where(self, name) -> str:
        return self._location.get(name, "the checkpoint")

    def __getitem__(self, name):
        f = self._location[name]
        try:
            return self._handles[f].get_tensor(self._raw[name])
        except Exception as e:  # safetensors raises its own error type for a short or corrupt file
            raise CheckpointError(f"{f}: cannot read tensor {name!r} ({e}); the file is truncated or corrupt") from e


def _open_safetensors(f: str):
    from safetensors import safe_open

    try:
        return safe_open(f, framework="pt", device="cpu")
    except Exception as e:  # SafetensorError (short header, truncated data), OSError
        raise CheckpointError(f"{f}: not a readable safetensors file ({e}); truncated or corrupt?") from e


def _checkpoint_files(path: str):
    """(files, index file or None, weight map or None): ``model.safetensors``, or else the shards
    its index names — transformers' order, so a folder holding both (``save_pretrained`` removes
    old shards but not an old index) loads the weights transformers loads; a warning names the
    index left unread."""
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        if os.path.lexists(index):
            warnings.warn(f"{path}: reading model.safetensors and ignoring model.safetensors.index.json beside it "
                          "(transformers reads model.safetensors first too); remove whichever a later save left "
                          "stale", stacklevel=3)
        return [single], None, None
    if os.path.isfile(index):
        check_file_size(index, MAX_CONFIG_BYTES, "a safetensors index (a real one is ~30 kB)", CheckpointError)
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:   # nested past the stack too
            raise CheckpointError(f"{index}: not a safetensors index with a 'weight_map' ({e})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                       for k, v in weight_map.items()):
            raise CheckpointError(f"{index}: 'weight_map' must map tensor names to shard file names")
        shards = sorted(set(weight_map.values()))
        for name in shards:
            if os.path.basename(name) != name:
                raise CheckpointError(f"{index}: shard {name!r} is not a file name inside the checkpoint folder")
            if not os.path.isfile(os.path.join(path, name)):
                raise FileNotFoundError(f"{index} names shard {name!r}, which is not in {path!r}")
        return [os.path.join(path, n) for n in shards], index, weight_map
    if os.path.lexists(single):  # glob lists it too: "found model.safetensors; rename it" would say nothing
        raise FileNotFoundError(f"{single!r} is not a readable file (a broken or looping symlink?)")
    found = sorted(os.path.basename(f) for f in glob.glob(os.path.join(path, "*.safetensors")))
    pickled = sorted(os.path.basename(f) for f in glob.glob(os.path.join(path, "pytorch_model*.bin")))
    raise FileNotFoundError(f"{path!r} has no model.safetensors or model.safetensors.index.json"
                            + (f" (found {found}; rename the weights file to model.safetensors)" if found else "")
                            + (f" (found {pickled}: only safetensors weights are read; save the model again with "
                               "transformers' save_pretrained, which writes safetensors)" if pickled else ""))


def load_checkpoint(path: str, dtype=torch.float32, device="cpu") -> Qwen3Weights:
    """From a local HF checkpoint folder: config.json + ``model.safetensors``, or else the shards that
    ``model.safetensors.index.json`` names (every tensor of every shard must be in the index, and
    every tensor of the index in its shard). Other ``*.safetensors`` files in the folder are not
    read (a warning names them). A Qwen3ForCausalLM or a Qwen3ForSequenceClassification reranker
    (``score.weight``). Raises FileNotFoundError or CheckpointError naming the file and tensor.
    """
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint folder {path!r} does not exist")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{path!r} has no config.json")
    check_file_size(cfg_path, MAX_CONFIG_BYTES, "config.json (a Qwen3 config is ~1 kB)", CheckpointError)
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (ValueError, OSError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError: ValueErrors
        raise CheckpointError(f"{cfg_path}: not a valid JSON config ({e})") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{cfg_path}: expected a JSON object, got {type(cfg).__name__}")
    try:
        arch = Qwen3Arch.from_config(cfg)
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{cfg_path}: {e}") from None
    files, index, weight_map = _checkpoint_files(path)
    stray = sorted(set(glob.glob(os.path.join(path, "*.safetensors"))) - set(files))
    if stray:
        warnings.warn(f"{path}: ignoring {[os.path.basename(f) for f in stray]}: not part of the checkpoint "
                      f"({'not named by ' + os.path.basename(index) if index else 'only model.safetensors is read'})",
                      stacklevel=2)
    handles, location, raw = {}, {}, {}
    for f in files:
        h = handles[f] = _open_safetensors(f)
        for key in h.keys():
            name = key[len("base_model."):] if key.startswith("base_model.") else key
            if name in location:
                raise CheckpointError(f"tensor {name!r} is in both {location[name]} and {f}")
            location[name], raw[name] = f, key
            if weight_map is not None and weight_map.get(key) != os.path.basename(f):
                raise CheckpointError(f"{index} does not list tensor {key!r} of shard {f} "
                                      f"(it says {weight_map.get(key)!r}); the index does not match its shards")
    if weight_map is not None:
        missing = [k for k, v in weight_map.items() if (k[len("base_model."):] if k.startswith("base_model.") else k)
                   not in location]
        if missing:
            raise CheckpointError(f"{index} lists tensor {missing[0]!r} in {weight_map[missing[0]]!r}, which does not "
                                  f"contain it ({len(missing)} such tensors)")
    # a bare Qwen3Model's names (save_pretrained of the decoder alone, a head perhaps beside it)
    location, raw = causal_lm_names(location), causal_lm_names(raw)
    sd = _LazyTensors(handles, location, raw)
    source = f"checkpoint {path!r} ({os.path.basename(index) if index else 'model.safetensors'})"
    return _from_state_dict(arch, sd, dtype, torch.device(device), source=source, id2label=cfg.get("id2label"),
                            config_source=cfg_path, label2id=cfg.get("label2id"),
                            architectures=cfg.get("architectures"), pad_token_id=cfg.get("pad_token_id"))
