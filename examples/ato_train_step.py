"""One Adaptive Tutoring Optimization (ATO) training loop on a tiny random Qwen3, end to end.

AdaTutoRank (2026), §3.4 and Algorithm 1: per update, freeze the policy as the snapshot π_old,
score each rollout (Eq. 4–6), standardise within the group (Eq. 7), route a hint to each rollout
(Eq. 8), re-score every rollout under the hint-free snapshot and the hint-conditioned frozen
teacher π_φ = θ_sft (Eq. 9, the teacher truncated to its top-128 logits), combine the two
advantages (Eq. 10) and take clipped policy-gradient steps (Eq. 11–12).

What is real here: the prompts (Appendix F.1), the rollouts (``sample_rollouts``: G samples of the
snapshot, the prompt computed once for all G), the hints (Fig. 3), the rubric reward's
aggregation, ``rescore`` (prefix-shared passes of both models, top-128 truncation without
[T, V] logits), the advantages and the loss, the policy's log-probs with ``linear_logprob`` (no
[T, V] logits in forward or backward either), backward and an optimizer step. What is a stand-in:
the models are tiny and random, the judge is a function of the selected ids, and the sibling set
is fixed.

The rollouts are sampled under the identifier grammar by default. The paper samples π_old
unconstrained (``--free``), so that a malformed rollout gets r = −1 and no distillation (Eq. 6):
that is how RL keeps teaching the format, and it is ``sample_rollouts``' default. But a random
model never writes a valid selection: unconstrained, every reward here would be −1 and every
advantage 0 (try ``--free``). Constrained draws give rewards that differ within the group. The
loss's ratio is over the full vocabulary either way, so ``logp_old`` comes from ``rescore``
(a constrained draw's own log-prob is renormalised over the allowed tokens: not π_old's).

    python examples/ato_train_step.py [--steps 3] [--group 4] [--layers 2] [--hidden 64] [--free]

``main(argv)`` returns the per-step losses (tests/ato/test_ato_train_step.py runs it tiny).
"""

import argparse
import copy
import json
from typing import List, Sequence

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from acarerank.ato import (
    RescoreQuery, clipped_policy_loss, grpo_advantage, ato_advantage, hint_text, linear_logprob,
    parse_selection, rescore, route_hints, rubric_reward, sample_rollouts, split_student_prompt,
)
from acarerank.model import Qwen3Runner
from acarerank.setwise.grammar import IdentifierGrammar
from acarerank.setwise.prompts import build_prompt
from acarerank.tokenizer import load_qwen3_tokenizer

RUBRICS = {
    "Relevance": [{"rubric": "Does each document state the tower's height?", "weight": 5}],
    "Completeness": [{"rubric": "Does the set give the height and the year it was built?", "weight": 3}],
}
DOCS = ["The Eiffel Tower is 330 metres tall.", "Paris is the capital of France.",
        "It was completed in 1889 for the World's Fair.", "GRPO standardises rewards in a group."]
USEFUL = {1: 10, 2: 0, 3: 8, 4: 0}            # the stand-in judge's per-document Relevance
SIBLING = [1, 3]                                # the stand-in self-selector's sibling set


def judge(selected: Sequence[int]) -> str:
    """A stand-in for the rubric judge: its F.5 JSON reply for the selected 1-based ids."""
    covered = sum(1 for i in selected if i in (1, 3))
    return json.dumps({"score": {
        "Relevance": {"level": "doc", "rubrics": [
            {"rubric": "", "per_doc": [{"doc_id": i, "score": USEFUL[i]} for i in selected]}]},
        "Completeness": {"level": "set", "rubrics": [{"rubric": "", "set_level": {"score": 5 * covered}}]},
    }})


def reward(text: str, n_docs: int):
    """(r_i, m_i) of Eq. 6 and Algorithm 1 lines 9–13: −1 and m = 0 for a malformed output."""
    parsed = parse_selection(text, n_docs)
    if not parsed.valid:
        return -1.0, False
    return rubric_reward(judge(parsed.ids), RUBRICS, parsed), True


def tiny_qwen3(vocab: int, layers: int, hidden: int, seed: int) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=hidden // 4, tie_word_embeddings=False, max_position_embeddings=4096)
    return Qwen3ForCausalLM(cfg).float()


def policy_logprobs(model, prompt: List[int], rollouts: List[List[int]], L: int,
                    temperature: float = 1.0) -> torch.Tensor:
    """log π_θ of every rollout token, [N, L] (0 at padding), differentiable in the model.

    Row i, column l is the log-prob of rollouts[i][l] given prompt ++ rollouts[i][:l] — the layout
    of ``rescore(...).logp_old`` (rollouts in order, left-aligned, padded to L). The hidden state
    that predicts token l sits at position len(prompt) + l − 1. ``linear_logprob`` takes the
    hidden states after the final norm (transformers' ``model.model(...).last_hidden_state``)
    and the lm_head weight, so no [T, V] logits are held in forward or backward.
    """
    P, N = len(prompt), len(rollouts)
    S = P + max(len(r) for r in rollouts)
    ids = torch.zeros(N, S, dtype=torch.long)
    attn = torch.zeros(N, S, dtype=torch.long)
    for i, r in enumerate(rollouts):          # right padding: positions 0..P+n−1 are real
        ids[i, :P + len(r)] = torch.tensor(prompt + list(r))
        attn[i, :P + len(r)] = 1
    hidden = model.model(input_ids=ids, attention_mask=attn).last_hidden_state   # [N, S, H]
    rows = torch.tensor([i for i, r in enumerate(rollouts) for _ in r], dtype=torch.long)
    cols = torch.tensor([l for r in rollouts for l in range(len(r))], dtype=torch.long)
    targets = torch.tensor([t for r in rollouts for t in r], dtype=torch.long)
    lp = linear_logprob(hidden[rows, P - 1 + cols], model.lm_head.weight, targets,
                        temperature=temperature)                              # [T] fp32
    out = torch.zeros(N, L, dtype=lp.dtype)
    return out.index_put((rows, cols), lp)


def main(argv=None) -> List[float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3, help="policy updates (each a new snapshot)")
    ap.add_argument("--inner", type=int, default=2, help="clipped steps per update")
    ap.add_argument("--group", type=int, default=4, help="G rollouts per query")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--lam", type=float, default=0.7)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--free", action="store_true",
                    help="sample unconstrained, as the paper does (a random model: every reward -1)")
    args = ap.parse_args(argv)

    tok = load_qwen3_tokenizer()
    grammar = None if args.free else IdentifierGrammar.from_tokenizer(tok)
    student = tiny_qwen3(len(tok), args.layers, args.hidden, args.seed)      # θ = θ_sft
    teacher = Qwen3Runner.from_hf(copy.deepcopy(student).eval())            # π_φ = θ_sft, frozen
    opt = torch.optim.AdamW(student.parameters(), lr=args.lr)

    max_select = 4
    prompt = build_prompt(tok, "How tall is the Eiffel Tower?", DOCS, max_select=max_select).input_ids
    head, tail = split_student_prompt(prompt)
    n = len(DOCS)
    sibling_reward = rubric_reward(judge(SIBLING), RUBRICS, SIBLING)
    losses = []
    for step in range(args.steps):
        # Algorithm 1 line 5: θ_old ← θ. The runner shares the model's tensors (from_hf), and the
        # optimizer below changes them in place, so the snapshot is built from a copy.
        snapshot = Qwen3Runner.from_hf(copy.deepcopy(student).eval())
        # Algorithm 1 line 7: G rollouts of π_old (at most 64 new tokens, stopping at <|im_end|>)
        rollouts = sample_rollouts(snapshot, [prompt], args.group, grammar=grammar,
                                   pools=None if args.free else [(n, max_select)], seed=args.seed + step).tokens
        scored = [reward(tok.decode(r, skip_special_tokens=True), n) for r in rollouts]
        rewards = torch.tensor([r for r, _ in scored])
        format_ok = torch.tensor([m for _, m in scored])
        a_grpo = grpo_advantage(rewards, torch.zeros(len(rollouts), dtype=torch.long))  # Eq. 7
        kinds = route_hints(rewards.tolist(), sibling_reward)                             # Eq. 8
        hints = [hint_text(k, rubrics=RUBRICS, sibling_ids=SIBLING, sibling_reward=sibling_reward,
                           reflection="[1] and [3] should be included; [2] and [4] are off topic.")
                 for k in kinds]
        res = rescore(snapshot, teacher, [RescoreQuery(head, tail, rollouts, hints)], tokenizer=tok)
        a_ato = ato_advantage(a_grpo, res.atd, format_ok, lam=args.lam,
                              response_mask=res.response_mask)                           # Eq. 10
        L = res.logp_old.shape[1]
        for inner in range(args.inner):
            logp = policy_logprobs(student, prompt, rollouts, L)
            if inner == 0:   # Lemma 1's premise: at θ = θ_old the policy re-scores like π_old
                drift = (logp.detach() - res.logp_old)[res.response_mask].abs().max().item()
                assert drift < 1e-3, f"policy and snapshot disagree at θ_old by {drift}"
            loss = clipped_policy_loss(logp, res.logp_old, a_ato, res.response_mask)     # Eq. 11
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        print(f"step {step}: rewards {rewards.tolist()} hints {kinds} "
              f"atd mean {res.atd[res.atd_mask].mean():+.3f} loss {losses[-args.inner]:+.5f}")
    return losses


if __name__ == "__main__":
    main()
