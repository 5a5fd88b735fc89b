"""bench/bench_setwise.py --quick --batch 2 runs: two prompts decoded together by acarerank and by
transformers' batched generate (left-padded) give the same tokens (the script exits 1 if not), and
its CSV carries the batch and both providers."""
import csv
import importlib.util

from _repo import ROOT


def _load():
    spec = importlib.util.spec_from_file_location("acarerank_bench_setwise", ROOT / "bench" / "bench_setwise.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_quick_batched_run_agrees_with_transformers(tmp_path, capsys):
    rc = _load().main(["--quick", "--batch", "2", "--output", str(tmp_path)])
    printed = capsys.readouterr()
    assert rc == 0, printed.out + printed.err
    rows = list(csv.DictReader((tmp_path / "bench_setwise.csv").open()))
    assert {(r["pool"], r["provider"]) for r in rows} == {(p, v) for p in ("10", "20")
                                                          for v in ("acarerank", "transformers")}, rows
    for r in rows:
        assert r["batch"] == "2" and r["tokens_agree"] == "True" and int(r["new_tokens"]) > 0, r


def test_bf16_near_tie_rule_separates_ties_from_disagreements():
    """``near_tie`` (the bf16 agreement rule): the first step where two decodes part, the fp32
    margin between the two picks there, against 4x transformers' bf16 logit error."""
    import torch
    from _tiny import random_qwen3

    near_tie = _load().near_tie
    model = random_qwen3(seed=3, dtype=torch.bfloat16)
    prompt = [11, 22, 33, 44, 55]
    with torch.no_grad():
        l32 = model.float()(torch.tensor([prompt])).logits[0, -1]
        model.to(torch.bfloat16)
    order = l32.argsort(descending=True)
    gaps = l32[order[:-1]] - l32[order[1:]]
    i = int(gaps[:1000].argmin())  # the two closest of the top 1000 logits
    tie_a, tie_b = int(order[i]), int(order[i + 1])
    vocab = torch.cat([order[:14], order[i:i + 2]])
    far = near_tie(model, prompt, [int(order[0]), 7], [int(order[-1]), 7], vocab)
    assert far["step"] == 0 and not far["near_tie"] and far["margin"] > 4 * far["error"] > 0, far
    tie = near_tie(model, prompt, [tie_a, 9], [tie_b, 9], vocab)
    assert tie["near_tie"] and tie["margin"] <= 4 * tie["error"], tie
    later = near_tie(model, prompt[:-1], [prompt[-1], tie_a], [prompt[-1], tie_b], vocab)
    assert later["step"] == 1 and later["margin"] == tie["margin"], (later, tie)  # parted after a common token
    assert model.dtype == torch.bfloat16 and model.lm_head.weight.dtype == torch.bfloat16  # left as it was
