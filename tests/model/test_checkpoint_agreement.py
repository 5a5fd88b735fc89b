"""Checkpoints the loader once read differently from transformers, with no error.

Oracles: transformers' own loading and forward on the same random weights (the model card's
scoring path for causal LMs; Qwen3ForSequenceClassification's logits for score heads).
"""
import json
import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from _tiny import random_qwen3, tiny_config, tiny_seq_cls
from acarerank import PointwiseReranker
from acarerank.model import CheckpointError
from acarerank.prompts import joint_input_ids, official_scores
from acarerank.tokenizer import load_qwen3_tokenizer

DOCS = ["alpha beta", "gamma delta epsilon", "the answer is 42", ""]


@pytest.fixture(scope="module")
def tok():
    return load_qwen3_tokenizer()


@pytest.fixture(scope="module")
def causal():
    return random_qwen3(seed=5, spread_yes_no=40)  # card scores 0.49-0.60: a 1e-5 tolerance is sharp


@pytest.fixture(scope="module")
def card_scores(causal, tok):
    return official_scores(causal, tok, [joint_input_ids(tok, "q", d) for d in DOCS], batch_size=1)


@pytest.fixture(scope="module")
def saved(causal, tmp_path_factory):
    path = tmp_path_factory.mktemp("agree") / "causal"
    causal.save_pretrained(path)
    return path


def close(a, b, tol=1e-5):
    return max(abs(x - y) for x, y in zip(a, b)) <= tol


def _edit_config(ckpt, drop=(), **set_):
    cfg = json.loads((ckpt / "config.json").read_text())
    for k in drop:
        cfg.pop(k, None)
    (ckpt / "config.json").write_text(json.dumps({**cfg, **set_}))


def _edit_tensors(ckpt, fn):
    sd = load_file(ckpt / "model.safetensors")
    fn(sd)
    save_file(sd, ckpt / "model.safetensors", metadata={"format": "pt"})


def _quiet_load(path):
    """from_pretrained (fp32, as the oracles) with every warning an error: a real layout loads silently."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return PointwiseReranker.from_pretrained(str(path), dtype=torch.float32)


# -- 1. which row of a 2-row score.weight is "yes" ---------------------------------------

def _labelled_head(causal, labels):
    """A 2-row Qwen3ForSequenceClassification whose rows are the causal LM's no/yes rows in the
    order ``labels`` names them (normalised: "yes" / "relevant" is the yes row)."""
    seq = tiny_seq_cls(causal, 2)  # rows [no, yes]
    yes_first = labels[0].strip().lower() in ("yes", "relevant")
    if yes_first:
        with torch.no_grad():
            seq.score.weight.copy_(seq.score.weight.flip(0))
    seq.config.id2label = dict(enumerate(labels))
    seq.config.label2id = {v: i for i, v in enumerate(labels)}
    return seq, 0 if yes_first else 1


@pytest.mark.parametrize("labels", [("yes", "no"), (" Relevant", "NOT_RELEVANT"), ("irrelevant", "relevant"),
                                    ("No", "Yes")])
def test_two_row_head_follows_id2label(causal, card_scores, tok, labels, tmp_path):
    """A score head whose config says id2label {0: "yes", 1: "no"} was read as [no, yes]: every
    score came out as 1 − the right one (0.9998 for 0.0002), with no error. The rows now follow
    the labels, in memory and from disk, as transformers' softmax at the "yes" label."""
    seq, yes = _labelled_head(causal, labels)
    with torch.no_grad():
        ref = [float(seq(input_ids=torch.tensor([joint_input_ids(tok, "q", d)])).logits[0].softmax(-1)[yes])
               for d in DOCS]
    assert close(ref, card_scores)  # the labelled row is the model card's "yes"
    assert close(PointwiseReranker(model=seq).score("q", DOCS), ref)
    seq.save_pretrained(tmp_path / "seq")
    assert json.loads((tmp_path / "seq" / "config.json").read_text())["id2label"]["0"] == labels[0]
    assert close(_quiet_load(tmp_path / "seq").score("q", DOCS), ref)


@pytest.mark.parametrize("rows, id2label, match", [
    (2, {"0": "negative", "1": "positive"}, "'negative'"),
    (2, {"0": "yes", "1": "yes"}, "'yes'"),
    (2, {"0": "LABEL_1", "1": "LABEL_0"}, "'LABEL_1'"),
    (2, {"0": "no", "1": "yes", "2": "maybe"}, "names 3 labels but score.weight has 2"),
    (1, {"0": "no"}, "label its row 'yes'"),
], ids=["other-names", "twice-yes", "generic-swapped", "three-labels", "one-row-no"])
def test_score_labels_that_say_no_row_is_yes_are_refused(causal, rows, id2label, match, tmp_path):
    """Labels that name something else (or disagree with the rows) were ignored and the rows read
    as [no, yes]; now a CheckpointError naming config.json, the labels and the fix."""
    tiny_seq_cls(causal, rows).save_pretrained(tmp_path / "seq")
    _edit_config(tmp_path / "seq", drop=["label2id"], id2label=id2label)
    with pytest.raises(CheckpointError, match=rf"config\.json: id2label .*{match}"):
        PointwiseReranker.from_pretrained(str(tmp_path / "seq"))
    if len(id2label) == rows:  # in memory too (a transformers config cannot hold a count mismatch)
        seq = tiny_seq_cls(causal, rows)
        seq.config.id2label = {int(k): v for k, v in id2label.items()}
        with pytest.raises(CheckpointError, match=rf"model's config: id2label .*{match}"):
            PointwiseReranker(model=seq)


@pytest.mark.parametrize("rows, id2label, label2id, match", [
    (2, {"0": "no", "1": "yes"}, {"no": 1, "yes": 0}, "maps 'no' to row 1, where id2label has 'yes'"),
    (2, {"0": "LABEL_0", "1": "LABEL_1"}, {"yes": 0, "no": 1}, "maps 'yes' to row 0, where id2label has 'LABEL_0'"),
    (2, {"0": "no", "1": "yes"}, {"no": 0, "yes": 2}, "maps 'yes' to 2, not a row of score.weight"),
    (1, {"0": "yes"}, {"no": 0}, "maps 'no' to row 0, where id2label has 'yes'"),
], ids=["swapped", "generic-id2label", "no-such-row", "one-row-no"])
def test_label2id_that_disagrees_with_id2label_is_refused(causal, rows, id2label, label2id, match, tmp_path):
    """transformers reads only id2label; a label2id that puts "yes" on another row was loaded
    without a word, whichever of the two the config's writer meant. Now a CheckpointError
    naming config.json and both maps, from disk and in memory."""
    tiny_seq_cls(causal, rows).save_pretrained(tmp_path / "seq")
    _edit_config(tmp_path / "seq", id2label=id2label, label2id=label2id)
    with pytest.raises(CheckpointError, match=rf"config\.json: label2id .* disagrees with id2label .*{match}"):
        PointwiseReranker.from_pretrained(str(tmp_path / "seq"))
    seq = tiny_seq_cls(causal, rows)
    seq.config.id2label, seq.config.label2id = {int(k): v for k, v in id2label.items()}, label2id
    with pytest.raises(CheckpointError, match=rf"model's config: label2id .*{match}"):
        PointwiseReranker(model=seq)


@pytest.mark.parametrize("label2id", [{"no": 0, "yes": 1}, {"Not_Relevant": 0, "relevant": 1},
                                      {"LABEL_0": 0, "LABEL_1": 1}, {"yes": 1}])
def test_label2id_that_agrees_with_id2label_loads(causal, card_scores, label2id, tmp_path):
    """The inverse map, yes / no names at the rows read as yes / no, and transformers' generic
    names (left in a config whose id2label was renamed) say the same rows."""
    tiny_seq_cls(causal, 2).save_pretrained(tmp_path / "seq")
    _edit_config(tmp_path / "seq", id2label={"0": "no", "1": "yes"}, label2id=label2id)
    assert close(_quiet_load(tmp_path / "seq").score("q", DOCS), card_scores)


def test_one_row_head_labelled_yes_is_the_yes_no_direction(causal, card_scores, tmp_path):
    tiny_seq_cls(causal, 1).save_pretrained(tmp_path / "seq")
    _edit_config(tmp_path / "seq", id2label={"0": "yes"}, label2id={"yes": 0})
    assert close(_quiet_load(tmp_path / "seq").score("q", DOCS), card_scores)


# -- 2. shape fields config.json may omit --------------------------------------------------

@pytest.mark.parametrize("shape, drop", [(dict(heads=2, kv_heads=1, head_dim=128), "head_dim"),
                                         (dict(heads=64, kv_heads=32, head_dim=8), "num_key_value_heads")])
def test_absent_shape_field_is_qwen3configs_default(tok, shape, drop, tmp_path):
    """config.json without head_dim is head_dim 128 and without num_key_value_heads is 32 in
    transformers' Qwen3Config; the loader took hidden/heads and num_attention_heads, and refused
    these checkpoints (which transformers loads). Scores against transformers' from_pretrained."""
    from transformers import Qwen3ForCausalLM

    random_qwen3(seed=2, spread_yes_no=40, hidden=32, **shape).save_pretrained(tmp_path / "c")
    _edit_config(tmp_path / "c", drop=[drop])
    hf = Qwen3ForCausalLM.from_pretrained(str(tmp_path / "c"), attn_implementation="eager").eval()
    want = official_scores(hf, tok, [joint_input_ids(tok, "q", d) for d in DOCS], batch_size=1)
    assert close(_quiet_load(tmp_path / "c").score("q", DOCS), want)


def test_absent_head_dim_that_disagrees_with_the_tensors_is_named(saved, tmp_path):
    """head_dim 16 tensors (= hidden/heads) under a config without head_dim: transformers reads
    128 and refuses the shapes; the loader used to accept 16. The error names the tensor, both
    shapes, the fields and the missing key."""
    ckpt = shutil.copytree(saved, tmp_path / "c")
    _edit_config(ckpt, drop=["head_dim"])
    with pytest.raises(CheckpointError, match=r"q_proj\.weight' has shape \(32, 32\), the config implies \[256, 32\] "
                                              r"\(num_attention_heads 2 × head_dim 128, hidden_size 32\); the config "
                                              r"has no 'head_dim'.*is head_dim missing from config\.json"):
        PointwiseReranker.from_pretrained(str(ckpt))


@pytest.mark.parametrize("field, value", [("num_key_value_heads", 0), ("head_dim", None), ("head_dim", 0)])
def test_shape_field_transformers_cannot_build_is_refused(saved, field, value, tmp_path):
    """num_key_value_heads 0 was read as num_attention_heads and head_dim null as hidden/heads:
    transformers cannot build either model (division by zero; head_dim must be an int)."""
    ckpt = shutil.copytree(saved, tmp_path / "c")
    _edit_config(ckpt, **{field: value})
    with pytest.raises(CheckpointError, match=rf"config\.json: config field '{field}' must be a positive int"):
        PointwiseReranker.from_pretrained(str(ckpt))


def test_odd_head_dim_is_refused(saved, tmp_path):
    """RoPE rotates a head's two halves into each other: an odd head_dim has no such halves
    (transformers' Qwen3Config refuses it; it is named before any tensor is read)."""
    ckpt = shutil.copytree(saved, tmp_path / "c")
    _edit_config(ckpt, head_dim=7)
    with pytest.raises(CheckpointError, match=r"config\.json: config field 'head_dim' must be even .*got 7"):
        PointwiseReranker.from_pretrained(str(ckpt))


def test_absent_num_key_value_heads_that_cannot_divide_is_named(saved, tmp_path):
    ckpt = shutil.copytree(saved, tmp_path / "c")
    _edit_config(ckpt, drop=["num_key_value_heads"])
    with pytest.raises(CheckpointError, match=r"num_attention_heads 2 is not a multiple of num_key_value_heads 32; "
                                              r"the config has no 'num_key_value_heads'"):
        PointwiseReranker.from_pretrained(str(ckpt))


@pytest.mark.parametrize("field, value", [("tie_word_embeddings", "false"), ("attention_bias", "false"),
                                          ("use_sliding_window", "false"), ("rms_norm_eps", "1e-6"),
                                          ("rms_norm_eps", None)])
def test_flag_or_number_of_the_wrong_type_is_refused(saved, field, value, tmp_path):
    """bool("false") is True: an untied checkpoint without lm_head.weight under
    ``"tie_word_embeddings": "false"`` scored with the embedding as its output layer, with no error
    (transformers' Qwen3Config refuses the string, as it refuses a quoted or null rms_norm_eps)."""
    from transformers import Qwen3ForCausalLM

    ckpt = shutil.copytree(saved, tmp_path / "c")
    _edit_config(ckpt, **{field: value})
    _edit_tensors(ckpt, lambda sd: sd.pop("lm_head.weight"))
    with pytest.raises(Exception, match=field):
        Qwen3ForCausalLM.from_pretrained(str(ckpt))
    with pytest.raises(CheckpointError, match=rf"config\.json: config field '{field}' must be"):
        PointwiseReranker.from_pretrained(str(ckpt))


def _layer_types(ckpt, types):
    """config.json's layer_types set to ``types(num_hidden_layers)``."""
    n = json.loads((ckpt / "config.json").read_text())["num_hidden_layers"]
    _edit_config(ckpt, layer_types=types(n))
    return n


@pytest.mark.parametrize("types, match", [
    (lambda n: ["full_attention"] * (n + 1), "'layer_types' has {m} entries but num_hidden_layers is {n}"),
    (lambda n: ["full_attention"] * (n - 1), "'layer_types' has {m} entries but num_hidden_layers is {n}"),
    (lambda n: ["full_attention"] * (n - 1) + ["bogus"], r"'layer_types' has \['bogus'\], not a Qwen3 layer type"),
], ids=["longer", "shorter", "unknown"])
def test_layer_types_not_one_qwen3_type_per_layer_is_refused(saved, types, match, tmp_path):
    """layer_types of another length than num_hidden_layers, or naming a type no model has,
    loaded without a word; transformers' Qwen3Config refuses both."""
    from transformers import Qwen3ForCausalLM

    ckpt = shutil.copytree(saved, tmp_path / "c")
    n = _layer_types(ckpt, types)
    with pytest.raises(Exception, match="layer_types"):
        Qwen3ForCausalLM.from_pretrained(str(ckpt))
    with pytest.raises(CheckpointError, match=rf"config\.json: config field {match.format(m=len(types(n)), n=n)}"):
        PointwiseReranker.from_pretrained(str(ckpt))


def test_layer_types_qwen3_cannot_run_is_refused(saved, tmp_path):
    """A layer type transformers knows from other models (its Qwen3Config takes it) that Qwen3's
    decoder has no mask for: refused before any weight is read."""
    ckpt = shutil.copytree(saved, tmp_path / "c")
    _layer_types(ckpt, lambda n: ["full_attention"] * (n - 1) + ["linear_attention"])
    with pytest.raises(CheckpointError, match=r"'layer_types' has \['linear_attention'\], not a Qwen3 layer type"):
        PointwiseReranker.from_pretrained(str(ckpt))


def test_sliding_window_left_out_is_qwen3configs_default_window(saved, tmp_path):
    """use_sliding_window true with no sliding_window key: transformers' Qwen3Config takes its
    default window, 4,096, and slides layers from max_window_layers on; the loader once read the
    absent key as no window and attended to every token, with no error."""
    from transformers import Qwen3Config

    ckpt = shutil.copytree(saved, tmp_path / "c")
    _edit_config(ckpt, drop=("sliding_window", "layer_types"), use_sliding_window=True, max_window_layers=0)
    hf = Qwen3Config.from_pretrained(str(ckpt))
    assert hf.sliding_window == 4096 and set(hf.layer_types) == {"sliding_attention"}
    with pytest.raises(CheckpointError, match=r"config\.json: sliding-window attention .*sliding_window=4096"):
        PointwiseReranker.from_pretrained(str(ckpt))


def test_sliding_layer_without_a_window_is_refused(saved, tmp_path):
    """layer_types naming a sliding_attention layer while use_sliding_window is false: transformers'
    forward raises (no window to slide); the loader once ran the layer as full attention."""
    from transformers import Qwen3ForCausalLM

    ckpt = shutil.copytree(saved, tmp_path / "c")
    _edit_config(ckpt, use_sliding_window=False, sliding_window=8)
    _layer_types(ckpt, lambda n: ["full_attention"] * (n - 1) + ["sliding_attention"])
    hf = Qwen3ForCausalLM.from_pretrained(str(ckpt)).eval()
    with pytest.raises(ValueError, match="sliding_window"):
        hf(torch.tensor([[1, 2, 3]]), use_cache=False)
    with pytest.raises(CheckpointError, match=r"config\.json: layer_types makes layers \[\d+\] sliding_attention but "
                                              r"the config gives no window \(use_sliding_window False"):
        PointwiseReranker.from_pretrained(str(ckpt))


def test_legacy_layer_type_name_loads(saved, card_scores, tmp_path):
    """transformers reads the legacy "attention" as "full_attention"."""
    ckpt = shutil.copytree(saved, tmp_path / "c")
    _layer_types(ckpt, lambda n: ["attention"] * n)
    assert close(_quiet_load(ckpt).score("q", DOCS), card_scores)


# -- 3. stored tensors the model does not read ----------------------------------------------

def test_layers_beyond_num_hidden_layers_are_refused(tmp_path):
    """A 2-layer checkpoint under num_hidden_layers 1 scored with layer 0 alone (transformers too,
    after a warning): the config and the weights disagree, so it is a CheckpointError."""
    random_qwen3(seed=3, layers=2).save_pretrained(tmp_path / "c")
    _edit_config(tmp_path / "c", num_hidden_layers=1, layer_types=["full_attention"])
    with pytest.raises(CheckpointError, match=r"tensors of layers \[1\] but num_hidden_layers is 1"):
        PointwiseReranker.from_pretrained(str(tmp_path / "c"))


@pytest.mark.parametrize("unmerged", [False, True], ids=["beside", "base_layer"])
def test_unmerged_adapter_is_refused(saved, unmerged, tmp_path):
    """LoRA tensors beside the base weights were ignored (scores of the base model); peft's
    unmerged layout (``q_proj.base_layer.weight``) got "no tensor q_proj.weight". Both now say to
    merge the adapter."""
    ckpt = shutil.copytree(saved, tmp_path / "c")
    p = "model.layers.0.self_attn.q_proj."

    def add_lora(sd):
        if unmerged:
            sd[p + "base_layer.weight"] = sd.pop(p + "weight")
        sd[p + "lora_A.default.weight"] = torch.zeros(4, 32)
        sd[p + "lora_B.default.weight"] = torch.zeros(32, 4)
    _edit_tensors(ckpt, add_lora)
    with pytest.raises(CheckpointError, match=r"unmerged adapter.*lora_A.*merge the adapter"):
        PointwiseReranker.from_pretrained(str(ckpt))


@pytest.mark.parametrize("extra", [2, 12])
def test_other_unused_tensors_are_named_in_one_warning(saved, tok, extra, tmp_path):
    """Tensors a Qwen3 does not have (an MLP bias, foreign keys) were dropped silently; transformers
    drops them too, with a warning. One UserWarning now names them (at most 10) and their count;
    scores are transformers' on the same folder."""
    from transformers import Qwen3ForCausalLM

    ckpt = shutil.copytree(saved, tmp_path / "c")
    names = ["model.layers.0.mlp.gate_proj.bias"] + [f"value_head.{i}.weight" for i in range(extra - 1)]
    _edit_tensors(ckpt, lambda sd: sd.update({n: torch.ones(48) for n in names}))
    hf = Qwen3ForCausalLM.from_pretrained(str(ckpt), attn_implementation="eager").eval()
    want = official_scores(hf, tok, [joint_input_ids(tok, "q", d) for d in DOCS], batch_size=1)
    with pytest.warns(UserWarning, match=rf"{extra} stored tensors are not used") as got:
        rr = PointwiseReranker.from_pretrained(str(ckpt), dtype=torch.float32)
    assert len(got) == 1
    shown = sorted(names)[:10]
    assert all(repr(n) in str(got[0].message) for n in shown)
    assert ("..." in str(got[0].message)) == (extra > 10)
    assert close(rr.score("q", DOCS), want)


def test_real_layouts_load_without_a_word(causal, card_scores, saved, tmp_path):
    """Causal LM (untied; tied with and without a stored lm_head), sequence-classification heads,
    a ``base_model.`` prefix and rotary inv_freq buffers of older exports: no warning."""
    assert close(_quiet_load(saved).score("q", DOCS), card_scores)
    tied = random_qwen3(seed=4, tie=True)
    tied.save_pretrained(tmp_path / "tied")
    _quiet_load(tmp_path / "tied")
    _edit_tensors(tmp_path / "tied", lambda sd: sd.update({"lm_head.weight": sd["model.embed_tokens.weight"].clone()}))
    _quiet_load(tmp_path / "tied")
    for rows in (1, 2):
        tiny_seq_cls(causal, rows).save_pretrained(tmp_path / f"seq{rows}")
        assert close(_quiet_load(tmp_path / f"seq{rows}").score("q", DOCS), card_scores)
    ckpt = shutil.copytree(saved, tmp_path / "old")

    def old_export(sd):
        for k in list(sd):
            sd["base_model." + k] = sd.pop(k)
        sd["model.rotary_emb.inv_freq"] = torch.ones(8)
        sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    _edit_tensors(ckpt, old_export)
    assert close(_quiet_load(ckpt).score("q", DOCS), card_scores)


def test_fields_that_change_the_math_at_other_values_score_as_transformers(tok, tmp_path):
    """Every Qwen3Config field the forward reads, off its usual value at once — rms_norm_eps 0.05,
    head_dim 24 (not hidden / heads = 16), rope_theta 5,000 in rope_parameters, a vocabulary padded
    past the tokenizer's (151,936), max_position_embeddings 256 (the default max_length becomes 256:
    docs/input-safety.md, "Positions"; the inputs fit, up to 114 tokens), pad_token_id and
    attention_dropout (inference reads neither), weights stored in bfloat16 over three shards —
    loads without a warning and scores as transformers' forward on the same files. Guard: no
    change behind it."""
    from transformers import Qwen3ForCausalLM

    docs = ["retrieval " * 40 + "tail"] + DOCS
    ids = [joint_input_ids(tok, "q", d) for d in docs]
    assert max(map(len, ids)) == 114
    m = random_qwen3(seed=5, spread_yes_no=40, perturb_norms=True, layers=2, hidden=64, intermediate=96, heads=4,
                     kv_heads=2, head_dim=24, vocab=151936, rms_norm_eps=0.05,
                     max_position_embeddings=256, pad_token_id=0, attention_dropout=0.3)
    m.config.rope_parameters["rope_theta"] = 5000.0
    m.to(torch.bfloat16).save_pretrained(tmp_path / "c", max_shard_size="2MB")
    assert len(list((tmp_path / "c").glob("model-*.safetensors"))) == 3
    hf = Qwen3ForCausalLM.from_pretrained(str(tmp_path / "c"), dtype=torch.float32, attn_implementation="eager").eval()
    want = official_scores(hf, tok, ids, batch_size=1)
    assert close(_quiet_load(tmp_path / "c").score("q", docs), want)


def test_head_dim_past_the_native_kernels_limit_scores_as_transformers(tok):
    """head_dim 576 (> the native attention and qk_norm_rope kernels' 512): the runner's CPU
    defaults walk on to the torch backends for those two ops and score as transformers' forward.
    The defaults were native whatever the shape: the model raised the kernel's RuntimeError."""
    m = random_qwen3(seed=5, spread_yes_no=40, head_dim=576)
    ref = official_scores(m, tok, [joint_input_ids(tok, "q", d) for d in DOCS], batch_size=1)
    rr = PointwiseReranker(model=m)
    assert close(rr.score("q", DOCS), ref)


# -- 4. the classes config.json's architectures declares --------------------------------------

def _headed(cls_name, causal):
    """A ``cls_name`` (transformers) over the causal LM's decoder, with a 2-label head."""
    import transformers

    m = getattr(transformers, cls_name)(tiny_config(num_labels=2, pad_token_id=0)).eval()
    m.base_model.load_state_dict(causal.model.state_dict())
    return m


@pytest.mark.parametrize("cls_name", ["Qwen3ForTokenClassification", "Qwen3ForQuestionAnswering"])
def test_a_qwen3_head_the_loader_would_misread_is_refused_by_its_class(causal, cls_name, tmp_path):
    """A token-classification checkpoint's score.weight (+ bias) was read as a reranker's yes/no
    head (scores with no meaning, a warning about the bias only); a question-answering one was a
    'missing shard'. Both are a CheckpointError naming the class, from disk and in memory."""
    m = _headed(cls_name, causal)
    m.save_pretrained(tmp_path / "c")
    assert json.loads((tmp_path / "c" / "config.json").read_text())["architectures"] == [cls_name]
    for load in (lambda: PointwiseReranker.from_pretrained(str(tmp_path / "c")), lambda: PointwiseReranker(model=m)):
        with pytest.raises(CheckpointError, match=f"architectures names '{cls_name}', which is not supported"):
            load()


def test_architectures_that_is_not_a_list_of_names_is_refused(saved, tmp_path):
    ckpt = shutil.copytree(saved, tmp_path / "c")
    _edit_config(ckpt, architectures="Qwen3ForCausalLM")
    with pytest.raises(CheckpointError, match=r"config\.json: 'architectures' must be a list of class names"):
        PointwiseReranker.from_pretrained(str(ckpt))


def test_a_headless_qwen3model_reads_as_transformers_causal_lm_with_a_warning(tok, tmp_path):
    """A Qwen3Model (the decoder alone) with tied embeddings is what transformers'
    Qwen3ForCausalLM.from_pretrained makes of it: the embedding as the output layer. It loads
    with a warning naming the class and scores as that (fp32: 1e-5) — from disk its unprefixed
    tensor names were a 'missing shard', in memory it loaded without a word. Untied, the missing
    output layer is a CheckpointError that names the class."""
    from transformers import Qwen3ForCausalLM, Qwen3Model

    tied = random_qwen3(seed=5, spread_yes_no=40, tie=True, perturb_norms=True)
    bare = Qwen3Model(tied.config).eval()
    bare.load_state_dict(tied.model.state_dict())
    bare.save_pretrained(tmp_path / "bare")
    assert json.loads((tmp_path / "bare" / "config.json").read_text())["architectures"] == ["Qwen3Model"]
    hf = Qwen3ForCausalLM.from_pretrained(str(tmp_path / "bare"), dtype=torch.float32,
                                          attn_implementation="eager").eval()
    want = official_scores(hf, tok, [joint_input_ids(tok, "q", d) for d in DOCS], batch_size=1)
    for load in (lambda: PointwiseReranker.from_pretrained(str(tmp_path / "bare"), dtype=torch.float32),
                 lambda: PointwiseReranker(model=bare)):
        with pytest.warns(UserWarning, match="architectures names 'Qwen3Model'.*tied embedding as its output layer"):
            rr = load()
        assert close(rr.score("q", DOCS), want)
    untied = Qwen3Model(tiny_config(tie=False)).eval()
    untied.save_pretrained(tmp_path / "untied")
    for load in (lambda: PointwiseReranker.from_pretrained(str(tmp_path / "untied")),
                 lambda: PointwiseReranker(model=untied)):
        with pytest.raises(CheckpointError, match="no tensor 'lm_head.weight'.*architectures names 'Qwen3Model'"):
            load()


@pytest.mark.parametrize("tie", [False, True])
def test_decoder_names_without_their_prefix_beside_an_lm_head_score_as_transformers(saved, tok, tmp_path, tie):
    """The decoder's tensors stored without ``model.`` (a bare Qwen3Model's names) beside an
    ``lm_head.weight``: transformers reads that head. Every name was prefixed, the head's too: untied,
    'no tensor lm_head.weight' (it is there); tied, the embedding was the output layer and the
    scores 0.11 off transformers', with only an "unused tensor" warning (tiny fp32 model)."""
    from transformers import Qwen3ForCausalLM

    ckpt = shutil.copytree(saved, tmp_path / "c")
    _edit_tensors(ckpt, lambda sd: sd.update({k[6:]: sd.pop(k) for k in list(sd) if k.startswith("model.")}))
    _edit_config(ckpt, tie_word_embeddings=tie)
    assert {"lm_head.weight", "embed_tokens.weight"} <= set(load_file(ckpt / "model.safetensors"))
    hf = Qwen3ForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32, attn_implementation="eager").eval()
    want = official_scores(hf, tok, [joint_input_ids(tok, "q", d) for d in DOCS], batch_size=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # tied: the stored head differs from the embedding (said, and used)
        rr = PointwiseReranker.from_pretrained(str(ckpt), dtype=torch.float32)
    got = rr.score("q", DOCS)
    assert close(got, want), f"{got} against transformers' {want}"


def test_another_family_named_over_qwen3_tensors_warns_and_scores_as_transformers(saved, tok, tmp_path):
    """architectures ['Qwen2ForCausalLM'] beside model_type qwen3 and a Qwen3's tensors: transformers'
    Auto classes pick Qwen3ForCausalLM by model_type, so it loads (it did, without a word) — now
    with a warning naming the declared class — and scores as that (fp32: 1e-5)."""
    from transformers import AutoModelForCausalLM

    ckpt = shutil.copytree(saved, tmp_path / "c")
    _edit_config(ckpt, architectures=["Qwen2ForCausalLM"])
    hf = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32, attn_implementation="eager").eval()
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    want = official_scores(hf, tok, [joint_input_ids(tok, "q", d) for d in DOCS], batch_size=1)
    with pytest.warns(UserWarning, match=r"architectures names \['Qwen2ForCausalLM'\].*read as a Qwen3ForCausalLM"):
        rr = PointwiseReranker.from_pretrained(str(ckpt), dtype=torch.float32)
    assert close(rr.score("q", DOCS), want)


def test_another_familys_tensors_under_model_type_qwen3_are_refused_naming_it(tmp_path):
    """A Qwen2ForCausalLM whose config says model_type qwen3 (transformers would load it as Qwen3
    with fresh q/k norms and drop the q/k/v biases): the missing q_norm is a CheckpointError that
    names the declared class, not only 'a missing shard'."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=503, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    Qwen2ForCausalLM(cfg).save_pretrained(tmp_path / "q2")
    _edit_config(tmp_path / "q2", model_type="qwen3", head_dim=16)
    with pytest.raises(CheckpointError, match=r"no tensor 'model\.layers\.0\.self_attn\.q_norm\.weight'.*"
                                              r"architectures names \['Qwen2ForCausalLM'\]"):
        PointwiseReranker.from_pretrained(str(tmp_path / "q2"))


def test_a_declared_head_the_tensors_do_not_carry_warns(causal, card_scores, saved, tmp_path):
    """config.json naming Qwen3ForCausalLM over a score.weight head (or Qwen3ForSequenceClassification
    over an lm_head) loaded without a word; transformers' named class would read those tensors
    otherwise. It still scores as the tensors say (the card's scores, 1e-5), now with a warning
    naming both; a checkpoint whose class matches its tensors loads silently."""
    tiny_seq_cls(causal, 2).save_pretrained(tmp_path / "seq")
    ckpt = shutil.copytree(saved, tmp_path / "causal")
    for path in (tmp_path / "seq", ckpt):
        with warnings.catch_warnings():
            warnings.simplefilter("error")   # the classes match the tensors: no warning
            PointwiseReranker.from_pretrained(str(path), dtype=torch.float32)
    _edit_config(tmp_path / "seq", architectures=["Qwen3ForCausalLM"])
    _edit_config(ckpt, architectures=["Qwen3ForSequenceClassification"])
    for path, match in ((tmp_path / "seq", r"\['Qwen3ForCausalLM'\] but the tensors carry a score\.weight head: "
                                           r"read as a Qwen3ForSequenceClassification"),
                        (ckpt, r"\['Qwen3ForSequenceClassification'\] but the tensors carry an lm_head and no "
                               r"score\.weight: read as a Qwen3ForCausalLM")):
        with pytest.warns(UserWarning, match=match):
            rr = PointwiseReranker.from_pretrained(str(path), dtype=torch.float32)
        assert close(rr.score("q", DOCS), card_scores), path
