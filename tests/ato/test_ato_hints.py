"""route_hints against Eq. 8 / Algorithm 1 lines 20–35 and the paper's Table 5 examples; hint texts."""
import pytest
import torch

from acarerank.ato import HINT_REFLECTION, HINT_RUBRIC, HINT_SIBLING, hint_ids, hint_text, route_hints
from acarerank.ato.hints import HINT_SEPARATOR


def test_table5_rag_query():
    """RAG query of Table 5: sibling set [2] [14] scored 9.25 by the judge."""
    assert route_hints([9.25, 4.00], 9.25) == [HINT_RUBRIC, HINT_REFLECTION]


def test_table5_deep_research_query():
    """Deep-research query of Table 5: sibling set [2] [6] [1] [3] scored 9.32."""
    assert route_hints([8.84, 4.83, 0.00], 9.32) == [HINT_RUBRIC, HINT_REFLECTION, HINT_SIBLING]


def test_table5_contradiction_367_follows_the_equations():
    """Table 5 lists a sibling-set hint for r = 3.67, but Eq. 8 / Algorithm 1 with τ2 = 3 give a
    reflection (3 < 3.67 < 6). We follow the equations; a larger τ2 reproduces the table."""
    assert route_hints([3.67], 9.25) == [HINT_REFLECTION]
    assert route_hints([3.67], 9.25, tau2=3.67) == [HINT_SIBLING]


def test_boundaries_and_gate():
    # r = τ1 = 6 -> rubric; r = τ2 = 3 -> sibling; just above τ2 -> reflection
    assert route_hints([6.0, 5.999, 3.0, 3.001], 9.0) == [HINT_RUBRIC, HINT_REFLECTION, HINT_SIBLING, HINT_REFLECTION]
    # the gate: a rollout scoring at or above its sibling falls back to the rubric hint
    assert route_hints([5.0, 2.0, 2.0], 5.0) == [HINT_RUBRIC, HINT_SIBLING, HINT_SIBLING]
    assert route_hints([4.5, 1.0], [4.5, 0.5]) == [HINT_RUBRIC, HINT_RUBRIC]
    # zero margin: a sibling only just above the rollout passes
    assert route_hints([4.5], 4.5000001) == [HINT_REFLECTION]
    # no sibling set at all: everything below τ1 gets the rubrics
    assert route_hints([7.0, 4.0, 0.0], None) == [HINT_RUBRIC] * 3
    # a malformed rollout (r = −1) is routed like r ≤ τ2 (its m_i = 0 masks the hint's effect)
    assert route_hints([-1.0], 9.0) == [HINT_SIBLING]


def test_route_hints_bad_input():
    with pytest.raises(ValueError, match="tau1 > tau2"):
        route_hints([1.0], 5.0, tau1=3.0, tau2=3.0)
    with pytest.raises(ValueError, match="sibling_reward has 2 values for 3"):
        route_hints([1.0, 2.0, 3.0], [5.0, 6.0])
    with pytest.raises(ValueError, match="NaN"):
        route_hints([float("nan")], 5.0)
    # a str is not numbers: "56" was read character by character as rewards [5.0, 6.0]
    with pytest.raises(TypeError, match="rewards must be numbers, got a str"):
        route_hints("56", 2.0)
    with pytest.raises(TypeError, match="sibling_reward must be numbers, got a str"):
        route_hints([5.0, 6.0], "78")


def test_route_hints_takes_numpy_numbers():
    """A numpy scalar or 0-d array sibling_reward is one number for the group, as a float is
    (np.float32 is no Python float: it was "'numpy.float32' object is not iterable"); numpy arrays
    of rewards are rewards."""
    np = pytest.importorskip("numpy")
    want = route_hints([1.0, 4.0, 7.0], 5.0)
    assert want == [HINT_SIBLING, HINT_REFLECTION, HINT_RUBRIC]
    for sib in (np.float32(5.0), np.float64(5.0), np.int64(5), np.array(5.0), np.array([5.0])):
        assert route_hints([1.0, 4.0, 7.0], sib) == want, repr(sib)
    assert route_hints(np.array([1.0, 4.0, 7.0], dtype=np.float32), np.float32(5.0)) == want


RUBRICS = {
    "Relevance": [{"rubric": "Does each document directly discuss the director (by name) and nationality of "
                             "The Garden of Eden (1998) and/or One Night in Yoshiwara?", "weight": 5}],
    "Complementarity": [{"rubric": "Does the set contain at least one document identifying the director and "
                                   "nationality of each of the two films?", "weight": 5}],
    "Reachability": [{"rubric": "Can the comparison be completed from the set alone?", "weight": 3}],
    "Conflict": [],
}


def test_hint_texts_follow_figure3():
    r = hint_text(HINT_RUBRIC, rubrics=RUBRICS)
    assert r.startswith("Below are the scoring dimensions and key points that the optimal document subset")
    assert "[Doc-level rubrics]\n- Relevance (weight 5): Does each document directly discuss" in r
    assert "[Set-level rubrics]\n- Complementarity (weight 5)" in r
    assert "[Global-level rubrics]\n- Reachability (weight 3)" in r
    assert r.endswith("Strictly follow the rubrics above and select the optimal document subset.")
    s = hint_text(HINT_SIBLING, sibling_ids=[2, 14], sibling_reward=9.25)
    assert "(scored 9.25 out of 10 by the judge)" in s and "\n[2] [14]\n" in s
    f = hint_text(HINT_REFLECTION, reflection="Only [2] and [14] are needed.")
    assert f.startswith("Your current selection is not yet optimal.") and "Only [2] and [14] are needed." in f
    with pytest.raises(ValueError, match="unknown hint kind"):
        hint_text("demo")
    with pytest.raises(ValueError, match="sibling set's ids"):
        hint_text(HINT_SIBLING, sibling_ids=[2])


def test_hint_text_checks_its_inputs():
    """sibling_ids are distinct 1-based int ids (numpy / torch integers as ints), reflection a str,
    sibling_reward a judge reward in [0, 10]: "12" was printed "[1] [2]", [2.9, 5.5] "[2] [5]",
    [True, 0, -3, 2, 2] printed as given, bytes embedded as "b'...'", NaN "scored nan out of 10", and
    a numpy array of ids was "truth value of an array ... is ambiguous"."""
    np = pytest.importorskip("numpy")
    want = hint_text(HINT_SIBLING, sibling_ids=[2, 5], sibling_reward=8.0)
    assert "\n[2] [5]\n" in want
    for ids in (np.array([2, 5]), torch.tensor([2, 5]), (2, 5), [np.int64(2), np.int32(5)]):
        got = hint_text(HINT_SIBLING, sibling_ids=ids, sibling_reward=8.0)
        assert got == want, (ids, got)
    assert hint_text(HINT_SIBLING, sibling_ids=[2, 5], sibling_reward=np.float32(8.0)) == want
    # what route_hints takes, one item of it: a reward from its [G] tensor, ids from a tensor's items (0-d
    # tensors; they were "must be a number in [0, 10] ..., got tensor(8.)" and a TypeError)
    sib = torch.tensor([7.5, 8.0])
    for ids in (list(torch.tensor([2, 5])), [np.array(2), torch.tensor(5, dtype=torch.int32)]):
        for reward in (sib[1], torch.tensor(8), np.array(8.0), np.float64(8.0)):
            got = hint_text(HINT_SIBLING, sibling_ids=ids, sibling_reward=reward)
            assert got == want, (ids, reward, got)
    for ids, error, match in (("12", TypeError, "sibling_ids must be a list of int document ids, got str"),
                              ([2.9, 5.5], TypeError, "document ids must be ints, got 2.9"),
                              (np.array([2.9, 5.5]), TypeError, "document ids must be ints, got 2.9"),
                              ([True, 2], TypeError, "document ids must be ints, got True"),
                              ([torch.tensor(True), 2], TypeError, "document ids must be ints, got tensor\\(True\\)"),
                              ([torch.tensor(2.0), 5], TypeError, "document ids must be ints, got tensor\\(2."),
                              ([np.float64(2.0), 5], TypeError, r"document ids must be ints, got (np\.float64\()?2\.0\)? \(float64\)"),
                              ([torch.tensor([2]), 5], TypeError, "document ids must be ints, got tensor\\(\\[2\\]\\)"),
                              ([0, 2], ValueError, "1-based, got 0"), ([-3, 2], ValueError, "1-based, got -3"),
                              ([2, 2], ValueError, "repeated")):
        with pytest.raises(error, match=match):
            hint_text(HINT_SIBLING, sibling_ids=ids, sibling_reward=8.0)
    for reward in (float("nan"), float("inf"), -1.0, 10.5, True, "8", torch.tensor(True), np.True_,
                   torch.tensor(10.5), torch.tensor(float("nan")), torch.tensor([8.0]), np.array([8.0])):
        with pytest.raises(ValueError, match=r"sibling_reward must be a number in \[0, 10\]"):
            hint_text(HINT_SIBLING, sibling_ids=[2], sibling_reward=reward)
    assert "scored 10.00 out of 10" in hint_text(HINT_SIBLING, sibling_ids=[2], sibling_reward=10)
    with pytest.raises(TypeError, match="reflection must be a str, got bytes"):
        hint_text(HINT_REFLECTION, reflection=b"Drop document 3; keep 5.")
    with pytest.raises(ValueError, match="sibling set's ids"):
        hint_text(HINT_SIBLING, sibling_ids=np.array([], dtype=np.int64), sibling_reward=8.0)


@pytest.mark.parametrize("rubrics, error, match", [
    ({"Relevance": [{"rubric": "Does it answer?"}]}, ValueError, r"rubrics\['Relevance'\]\[0\] must be"),
    ({"Relevance": [{"weight": 5}]}, ValueError, r"rubrics\['Relevance'\]\[0\] must be"),
    ({"Relevance": [{"rubric": "ok", "weight": 5}, "Is it short?"]}, ValueError, r"rubrics\['Relevance'\]\[1\]"),
    ({"Relevance": "Does it answer?"}, TypeError, r"rubrics\['Relevance'\] must be a list"),
    ([("Relevance", [])], TypeError, "rubrics must be a mapping"),
])
def test_rubric_hint_names_a_malformed_rubric(rubrics, error, match):
    """The caller's rubric set, not a KeyError/AttributeError from inside the template."""
    with pytest.raises(error, match=match):
        hint_text(HINT_RUBRIC, rubrics=rubrics)


def test_hint_ids_equal_joint_tokenization(qwen3_tokenizer):
    """A hint spliced in with ``lead_token`` (the head's last token, re-tokenized with the seam)
    gives exactly the joint tokenization of the teacher text. Without it the seam differs:
    Qwen3 merges ".\n\n" into one token."""
    user_end = "Only respond with the selection; do not say any other word and do not explain."
    head = qwen3_tokenizer.encode(user_end, add_special_tokens=False)
    for h in (hint_text(HINT_RUBRIC, rubrics=RUBRICS), hint_text(HINT_SIBLING, sibling_ids=[2, 6, 1, 3], sibling_reward=9.32),
              hint_text(HINT_REFLECTION, reflection="  [3] should be included: it states 10,000 ILV.\n")):
        joint = qwen3_tokenizer.encode(user_end + HINT_SEPARATOR + h + "<|im_end|>", add_special_tokens=False)
        spliced = head[:-1] + hint_ids(qwen3_tokenizer, h, lead_token=head[-1]) + [151645]
        assert joint == spliced
        naive = head + hint_ids(qwen3_tokenizer, h) + [151645]
        assert naive != joint  # why lead_token exists
    assert hint_ids(qwen3_tokenizer, "", lead_token=13) == [13]
    assert hint_ids(qwen3_tokenizer, [5, 6], lead_token=13) == [13, 5, 6]
    with pytest.raises(TypeError, match="got bytes"):  # was ids [13, 111, 107]: bytes iterate as ints
        hint_ids(qwen3_tokenizer, b"ok", lead_token=13)
    # token ids are integers, as rescore takes them (docs/api.md): [1.7, 2.9] was [1, 2], [True, False] [1, 0]
    for bad, shown in (([1.7, 2.9], "1.7"), ([True, False], "True"), (torch.tensor([1.5]), "1.5")):
        with pytest.raises(TypeError, match=f"hint_ids: text: token ids must be integers, got {shown}"):
            hint_ids(qwen3_tokenizer, bad)
    with pytest.raises(TypeError, match="hint_ids: head: token ids must be integers, got 13.5"):
        hint_ids(qwen3_tokenizer, [5], head=[4, 13.5])
    assert hint_ids(qwen3_tokenizer, torch.tensor([5, 6]), head=[4, 13]) == [13, 5, 6]


# endings of the user text (after "... do not explain"): the separator's "\n\n" joins a punctuation run
# into one pre-token; for these BPE then changes more than the head's last token ("?" ";" -> "?;" "\n\n")
SEAM_REFUSED = ["?;", "!\"\"", "=:{", "!)]"]
SEAM_EXACT = [".", "", "?!", ":-)\"", "?;)", "!!!!!!!", ".»", " 😀", " é", " 数字12", "  ", "\t", ". [3]", "\u0301"]


@pytest.mark.parametrize("ending", SEAM_EXACT + SEAM_REFUSED)
def test_hint_ids_with_head_are_the_joint_tokenization_or_refused(qwen3_tokenizer, ending):
    """With ``head`` the splice head[:-1] + hint_ids is exactly the tokenization of the teacher text
    (user text + HINT_SEPARATOR + hint), or a ValueError where no splice after head[:-1] can be;
    the lead token alone re-tokenized (the former path) gave the refused endings other ids, silently."""
    tok = qwen3_tokenizer
    user = "Only respond with the selection; do not say any other word and do not explain" + ending
    hint = hint_text(HINT_SIBLING, sibling_ids=[2, 6], sibling_reward=9.32)
    head = tok.encode("<|im_start|>user\n" + user, add_special_tokens=False)
    joint = tok.encode("<|im_start|>user\n" + user + HINT_SEPARATOR + hint, add_special_tokens=False)
    lead_only = head[:-1] + hint_ids(tok, hint, lead_token=head[-1])
    if ending in SEAM_REFUSED:
        assert lead_only != joint  # why the check exists
        with pytest.raises(ValueError, match="re-tokenizes the prompt head's end"):
            hint_ids(tok, hint, head=head)
    else:
        assert head[:-1] + hint_ids(tok, hint, head=head) == joint
        assert hint_ids(tok, hint, head=head, lead_token=head[-1]) == hint_ids(tok, hint, head=head)


def test_hint_ids_head_names_its_bad_input(qwen3_tokenizer):
    tok = qwen3_tokenizer
    head = tok.encode("do not explain.", add_special_tokens=False)
    with pytest.raises(ValueError, match="head is empty"):
        hint_ids(tok, "hint", head=[])
    with pytest.raises(ValueError, match="ends in the control token 151644"):
        hint_ids(tok, "hint", head=head + [151644])
    with pytest.raises(ValueError, match="is not head's last token"):
        hint_ids(tok, "hint", head=head, lead_token=head[0])
    # an end that is not the tokenization of its text ("..." as "." "." "."): the seam cannot be checked
    odd = tok.encode("do not explain", add_special_tokens=False) + tok.encode(".", add_special_tokens=False) * 3
    assert odd != tok.encode("do not explain...", add_special_tokens=False)
    with pytest.raises(ValueError, match="are not the tokenization of their text"):
        hint_ids(tok, "hint", head=odd)
    assert hint_ids(tok, [5, 6], head=head) == [head[-1], 5, 6]  # token-id hints pass through
    assert hint_ids(tok, "", head=head) == [head[-1]]
