"""rescore (Algorithm 1 line 39) against transformers' forward on the full, unshared sequences.

Two random tiny Qwen3 models (snapshot and teacher, different seeds) with the real vocabulary
and the real tokenizer; real setwise prompts (acarerank.setwise.prompts). The unshared teacher
prompt is built by the prompt builder itself from user text + HINT_SEPARATOR + hint, so the
test also proves that splicing the tokenized hint into the shared prefix equals tokenizing
the teacher prompt as one string.
"""
import copy

import pytest
import torch

from acarerank.ato import HINT_REFLECTION, HINT_RUBRIC, HINT_SIBLING, RescoreQuery, hint_text, rescore, split_student_prompt
from acarerank.ato.hints import HINT_SEPARATOR
from acarerank.model import Qwen3Runner
from acarerank.model.default import build_default_model
from acarerank.setwise.prompts import chat_ids, system_prompt, user_prompt
from acarerank.tokenizer import TOKEN_IM_END

TINY = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)
RUBRICS = {"Relevance": [{"rubric": "Does each document name the director of One Night in Yoshiwara?", "weight": 5}],
           "Complementarity": [{"rubric": "Do the documents together cover both films?", "weight": 4}]}
QUERIES = [
    ("Do both films The Garden of Eden (1998) and One Night in Yoshiwara have directors of the same nationality?",
     ["The Garden of Eden is a 1998 film directed by Alessandro D'Alatri.", "Max Ophüls directed One Night in "
      "Yoshiwara (1932).", "Garden design in the 1990s.", "D'Alatri is an Italian director."], None),
    ("Illuvium Pre-season 2 rewards", ["An additional 10,000 ILV awaits in Pre-Season 2.", "Illuvium is a game.",
                                       "10,000 ILV added to an existing 20,000 ILV pool."], "find the ILV total"),
]


@pytest.fixture(scope="module")
def models():
    snap = build_default_model("tiny-cpu", seed=1, **TINY)
    teach = build_default_model("tiny-cpu", seed=2, **TINY)
    return snap, teach


def _greedy(model, ids, n):
    out = []
    with torch.no_grad():
        for _ in range(n):  # only the last position's logits: the others are never read
            nxt = int(model(input_ids=torch.tensor([ids + out]), logits_to_keep=1).logits[0, -1].argmax())
            out.append(nxt)
    return out


def _setup(tok, teacher_hf):
    """Per query: student prompt, hints, rollouts, and the unshared sequences for the oracle."""
    items, full_s, full_t = [], [], []
    for qi, (query, docs, intent) in enumerate(QUERIES):
        system, user = system_prompt(intent), user_prompt(query, docs, intent)
        prompt = chat_ids(tok, system, user)
        head, tail = split_student_prompt(prompt)
        hints = ([hint_text(HINT_RUBRIC, rubrics=RUBRICS), hint_text(HINT_SIBLING, sibling_ids=[2, 4], sibling_reward=9.25),
                  hint_text(HINT_REFLECTION, reflection="[2] and [4] should be included; [3] is off-topic.")]
                 if qi == 0 else ["", [1234, 99, 5000], hint_text(HINT_SIBLING, sibling_ids=[1], sibling_reward=9.32)])
        t_prompts = [chat_ids(tok, system, user + HINT_SEPARATOR + h) if isinstance(h, str) and h
                     else head + list(h) + tail for h in hints]
        # rollouts: one the teacher itself would emit greedily (targets inside its top-k), a
        # well-formed selection, and (query 1) an empty rollout
        rolls = [_greedy(teacher_hf, t_prompts[0], 5),
                 tok.encode("[2] [4]", add_special_tokens=False) + [TOKEN_IM_END],
                 tok.encode("[1] [3] [2]", add_special_tokens=False) if qi == 0 else []]
        items.append(RescoreQuery(head, tail, rolls, hints))
        for y, tp in zip(rolls, t_prompts):
            full_s.append((prompt, y))
            full_t.append((tp, y))
    return items, full_s, full_t


def _oracle_rows(model, prompt, y, temperature):
    """fp32 log-softmax rows that predict y's tokens, from transformers on prompt ++ y. Only the
    rows read are made (logits_to_keep: the last len(y) + 1 positions, P - 1 .. P + len(y) - 1; the
    last predicts past y and is dropped) — the same rows, bit for bit, as slicing all P + len(y)
    rows of the real vocabulary."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + y]), logits_to_keep=len(y) + 1).logits[0].float()
    return logits[:-1] / temperature


@pytest.fixture(scope="module")
def cases(models, qwen3_tokenizer):
    """``_setup``'s queries and, per rollout, the oracle's fp32 logit rows of snapshot and teacher at
    temperature 1 (None for an empty rollout): the transformers forwards do not depend on the
    temperature, so both parametrisations divide the same rows."""
    snap_hf, teach_hf = models
    items, full_s, full_t = _setup(qwen3_tokenizer, teach_hf)
    rows = [(_oracle_rows(snap_hf, ps, y, 1.0), _oracle_rows(teach_hf, pt, y, 1.0)) if y else None
            for (ps, y), (pt, _) in zip(full_s, full_t)]
    return items, full_s, full_t, rows


@pytest.mark.parametrize("temperature,outside", [(1.0, "floor"), (0.8, "full"), (1.0, "mask")])
def test_rescore_matches_unshared_transformers(models, cases, qwen3_tokenizer, temperature, outside):
    snap_hf, teach_hf = models
    items, full_s, _, rows = cases
    items = copy.deepcopy(items)  # rescore gets its own queries in each parametrisation
    snap, teach = Qwen3Runner.from_hf(snap_hf), Qwen3Runner.from_hf(teach_hf)
    groups_seen = []
    orig = teach.prefill
    teach.prefill = lambda prefixes, **kw: (groups_seen.append(len(prefixes)), orig(prefixes, **kw))[1]
    res = rescore(snap, teach, items, tokenizer=qwen3_tokenizer, k=128, outside=outside, temperature=temperature)
    assert groups_seen == [len(QUERIES)], "the teacher must prefill one shared prefix per query"

    lengths = [len(y) for _, y in full_s]
    assert res.lengths == lengths and res.logp_old.shape == (6, max(lengths))
    assert res.query_index.tolist() == [0, 0, 0, 1, 1, 1]
    k = 128
    n_in = 0
    for n, (_, y) in enumerate(full_s):
        L = len(y)
        assert res.response_mask[n].tolist() == [True] * L + [False] * (res.logp_old.shape[1] - L)
        if L == 0:
            continue
        tg = torch.tensor(y)
        zs, zt = (z / temperature for z in rows[n])
        want_old = zs.log_softmax(-1).gather(1, tg[:, None]).squeeze(1)
        top = torch.sort(zt, dim=1, descending=True, stable=True)
        top_z, top_i = top.values[:, :k], top.indices[:, :k]
        inside = (top_i == tg[:, None]).any(1)
        lp_in = zt.gather(1, tg[:, None]).squeeze(1) - torch.logsumexp(top_z, 1)
        lp_out = {"floor": torch.full((L,), -20.0), "mask": torch.zeros(L),
                  "full": zt.log_softmax(-1).gather(1, tg[:, None]).squeeze(1)}[outside]
        want_t = torch.where(inside, lp_in, lp_out)
        # "mask" drops a token outside the top-k: no distillation signal (atd 0), not 0 − logp_old
        want_atd = torch.where(inside, want_t - want_old, 0.0) if outside == "mask" else want_t - want_old
        n_in += int(inside.sum())
        for name, got, want in (("logp_old", res.logp_old[n, :L], want_old), ("logp_teacher", res.logp_teacher[n, :L], want_t),
                                ("atd", res.atd[n, :L], want_atd)):
            err = (got - want).abs()
            assert err.max() <= 1e-5, f"rollout {n} {name}: max err {err.max():.3e} at token {err.argmax().item()}"
        assert torch.equal(res.teacher_in_topk[n, :L], inside), f"rollout {n}: in_topk differs"
        assert torch.equal(res.atd_mask[n, :L], inside if outside == "mask" else torch.ones(L, dtype=torch.bool))
    assert 0 < n_in < sum(lengths), "the test must cover teacher targets inside and outside the top-k"
    assert torch.all(res.atd[~res.response_mask] == 0)


def test_rescore_results_are_ordinary_constants(models):
    """The results are constants a training loop edits and multiplies into its loss: ordinary
    tensors without grad, not inference tensors (which refused an in-place clamp and being
    saved for backward, though the models do run under inference_mode)."""
    snap, teach = (Qwen3Runner.from_hf(m) for m in models)
    res = rescore(snap, teach, [RescoreQuery([1, 2, 3], [4], [[5, 6, 7], [8]], [[9], []])])
    for name in ("logp_old", "logp_teacher", "atd", "response_mask", "teacher_in_topk", "atd_mask"):
        t = getattr(res, name)
        assert not t.is_inference() and not t.requires_grad, name
    want = res.atd.clone().clamp(-0.5, 0.5)
    res.atd.clamp_(-0.5, 0.5)  # in place
    assert torch.equal(res.atd, want)
    logp = torch.zeros_like(res.logp_old, requires_grad=True)
    (g,) = torch.autograd.grad((logp * res.atd).sum(), logp)  # saved for backward
    assert torch.equal(g, res.atd)


def test_rescore_bad_input(models):
    snap_hf, teach_hf = models
    snap, teach = Qwen3Runner.from_hf(snap_hf), Qwen3Runner.from_hf(teach_hf)
    with pytest.raises(ValueError, match="2 rollouts but 1 hints"):
        rescore(snap, teach, [RescoreQuery([1, 2], [3], [[4], [5]], [""])])
    with pytest.raises(ValueError, match="prompt_head is empty"):
        rescore(snap, teach, [RescoreQuery([], [3], [[4]], [""])])
    with pytest.raises(ValueError, match="outside"):
        rescore(snap, teach, [RescoreQuery([1], [3], [[4]], [""])], outside="drop")
    with pytest.raises(ValueError, match="outside \\[0, 151669\\)"):
        rescore(snap, teach, [RescoreQuery([1], [3], [[151669]], [""])])
    with pytest.raises(ValueError, match="closing the user turn"):
        split_student_prompt([1, 2, 3])
    # integers only, as rescore's own ids: 151645.5 was split as <|im_end|>, every float truncated
    with pytest.raises(TypeError, match="split_student_prompt: prompt_ids: token ids must be integers, got 151644.5"):
        split_student_prompt([151644.5, 872.5, 151645.5, 198.9])
    assert split_student_prompt(torch.tensor([1, 151645, 2])) == ([1], [151645, 2])
    # token ids are integers: a float is never truncated to an id, a bool never read as 0 / 1
    with pytest.raises(TypeError, match="query 0 rollout 0: token ids must be integers, got 4.7"):
        rescore(snap, teach, [RescoreQuery([1], [3], [[4.7]], [""])])
    with pytest.raises(TypeError, match="query 0 hint 0: token ids must be integers, got True"):
        rescore(snap, teach, [RescoreQuery([1], [3], [[4]], [[True]])])
    with pytest.raises(TypeError, match="query 0 rollout 0: token ids must be a 1-D integer sequence"):
        rescore(snap, teach, [RescoreQuery([1], [3], [torch.tensor([True])], [""])])
    # bytes are ints item by item: never read as ids (b"ab" was re-scored as ids 97, 98)
    with pytest.raises(TypeError, match="query 0 hint 0: expected token ids, got a bytes"):
        rescore(snap, teach, [RescoreQuery([1], [3], [[4]], [b"ab"])])
    with pytest.raises(TypeError, match="query 0 rollout 0: expected token ids, got a bytearray"):
        rescore(snap, teach, [RescoreQuery([1], [3], [bytearray(b"ab")], [""])])
    # an id outside the vocabulary names its input, not the runner's "segment 0" / "prefix 0"
    for q, where in ((RescoreQuery([1, 151669], [3], [[4]], [""]), "query 0 prompt_head"),
                     (RescoreQuery([1], [-1], [[4]], [""]), "query 0 prompt_tail"),
                     (RescoreQuery([1], [3], [[4], [5]], [[], torch.tensor([-2])]), "query 0 hint 1")):
        with pytest.raises(ValueError, match=f"{where} has token id -?\\d+ outside \\[0, 151669\\)"):
            rescore(snap, teach, [q])


def test_a_0d_array_is_not_token_ids():
    """A 0-d tensor / numpy array (one id where a sequence of ids belongs) is a TypeError naming the
    argument, as a bytes or an int is: it was the bare "'int' object is not iterable" (tolist() of a
    0-d array is one int). A 1-D one of one id is still one id."""
    import numpy as np
    from acarerank._validate import check_token_ids

    for x, kind in ((torch.tensor(151645), "Tensor"), (np.array(151645), "ndarray")):
        with pytest.raises(TypeError, match=f"^split_student_prompt: prompt_ids: expected token ids, got a 0-d {kind}"):
            split_student_prompt(x)
        with pytest.raises(TypeError, match=f"^hint_ids: text: expected token ids, got a 0-d {kind}"):
            check_token_ids("hint_ids: text", x)
    for x in (torch.tensor([5]), np.array([5]), [np.int64(5)], [torch.tensor(5)]):
        assert check_token_ids("x", x) == [5], x
    with pytest.raises(TypeError, match="^x: expected token ids, got a int"):
        check_token_ids("x", 5)


def test_unordered_token_ids_are_refused():
    """A set or a mapping has no order: {3, 1, 2} was read as ids [1, 2, 3] and a dict as its keys,
    another sequence scored with no error. A TypeError naming the argument now, at each public entry
    that takes ids; an ordered container of the same ids is still read as given."""
    from acarerank._validate import check_token_ids

    for x in ({3, 1, 2}, frozenset({3, 1, 2}), {3: "c", 1: "a"}, {3: 0, 1: 0}.keys()):
        with pytest.raises(TypeError, match=f"^split_student_prompt: prompt_ids: token ids are a sequence in order .*"
                                            f"got a {type(x).__name__}, which has no order"):
            split_student_prompt(x)
        with pytest.raises(TypeError, match=f"^hint_ids: text: token ids are a sequence in order .*{type(x).__name__}"):
            check_token_ids("hint_ids: text", x)
    for x in ([3, 1, 2], (3, 1, 2), {"a": 3, "b": 1, "c": 2}.values(), iter([3, 1, 2]), torch.tensor([3, 1, 2])):
        assert check_token_ids("x", x) == [3, 1, 2], x


def test_a_head_whose_end_the_hint_separator_re_tokenizes_is_refused(models, qwen3_tokenizer):
    """User text ending "?;": the teacher text's tokens end the head with "?;" "\\n\\n", not "?" ";",
    so a teacher prompt sharing head[:-1] is never its tokenization. Refused (naming the query and
    hint) before any pass; it was re-scored on ids the teacher text never tokenizes to."""
    snap, teach = (Qwen3Runner.from_hf(m) for m in models)
    head = qwen3_tokenizer.encode("<|im_start|>user\nWhich passages answer it?;", add_special_tokens=False)
    with pytest.raises(ValueError, match="query 0 hint 1: the hint separator"):
        rescore(snap, teach, [RescoreQuery(head, [TOKEN_IM_END], [[5], [6]], ["", "Hint: [2] is key."])],
                tokenizer=qwen3_tokenizer)


@pytest.mark.parametrize("tail", [[], "text"])
def test_a_text_hint_before_a_tail_of_plain_text_is_refused(models, qwen3_tokenizer, tail):
    """The teacher text is head_text + separator + hint + tail_text: a tail that starts with plain
    text (or no tail, the rollout next) would tokenize together with the hint's end there, so the
    spliced ids are no tokenization of the teacher's text. Refused, naming the query and hint;
    token-id hints and tails starting with <|im_end|> (split_student_prompt's) go on as before."""
    snap, teach = (Qwen3Runner.from_hf(m) for m in models)
    head = qwen3_tokenizer.encode("<|im_start|>user\nWhich passages answer it?", add_special_tokens=False)
    tail = qwen3_tokenizer.encode(" Think.", add_special_tokens=False) if tail == "text" else tail
    with pytest.raises(ValueError, match="query 0 hint 1: a text hint needs prompt_tail to start with a control token"):
        rescore(snap, teach, [RescoreQuery(head, tail, [[5], [6]], ["", "Hint: [2] is key."])],
                tokenizer=qwen3_tokenizer)
    out = rescore(snap, teach, [RescoreQuery(head, tail or [TOKEN_IM_END], [[5], [6]], [[7, 8], ""])],
                  tokenizer=qwen3_tokenizer)
    assert out.logp_teacher.shape == (2, 1)



def test_one_str_of_hints_or_rollouts_is_refused(models, qwen3_tokenizer):
    """hints (and rollouts) hold one entry per rollout: one str "Keep" for 4 rollouts passed the
    length check and each rollout was re-scored with a one-character hint 'K', 'e', 'e', 'p'."""
    snap, teach = (Qwen3Runner.from_hf(m) for m in models)
    head = qwen3_tokenizer.encode("<|im_start|>user\nWhich passages answer it?", add_special_tokens=False)
    rolls = [[5], [6], [7], [8]]
    for hints in ("Keep", b"Keep"):
        with pytest.raises(TypeError, match=f"query 0: hints must hold one entry per rollout .*{type(hints).__name__}"):
            rescore(snap, teach, [RescoreQuery(head, [TOKEN_IM_END], rolls, hints)], tokenizer=qwen3_tokenizer)
    with pytest.raises(TypeError, match="query 0: rollouts must hold one entry per rollout .*got a str"):
        rescore(snap, teach, [RescoreQuery(head, [TOKEN_IM_END], "ab", ["", ""])], tokenizer=qwen3_tokenizer)
    out = rescore(snap, teach, [RescoreQuery(head, [TOKEN_IM_END], rolls, ["Keep"] * 4)], tokenizer=qwen3_tokenizer)
    assert out.logp_teacher.shape == (4, 1)
