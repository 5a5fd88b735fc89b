"""The Qwen3-Reranker model card's own input construction and scoring — the oracle and the baseline.

Transcribed from the model card's transformers example (Qwen/Qwen3-Reranker-0.6B / -4B)::

    prefix_tokens = tokenizer.encode(prefix, add_special_tokens=False)
    suffix_tokens = tokenizer.encode(suffix, add_special_tokens=False)
    def process_inputs(pairs):
        inputs = tokenizer(pairs, padding=False, truncation='longest_first', return_attention_mask=False,
                           max_length=max_length - len(prefix_tokens) - len(suffix_tokens))
        for i, ele in enumerate(inputs['input_ids']):
            inputs['input_ids'][i] = prefix_tokens + ele + suffix_tokens
        inputs = tokenizer.pad(inputs, padding=True, return_tensors="pt", max_length=max_length)  # left padding
    def compute_logits(inputs):
        batch_scores = model(**inputs).logits[:, -1, :]
        batch_scores = torch.stack([batch_scores[:, token_false_id], batch_scores[:, token_true_id]], dim=1)
        return torch.nn.LogSoftmax(dim=1)(batch_scores)[:, 1].exp().tolist()

Nothing here shares a prefix or reads only two logits: it is what our fast path must equal
(the tests' oracle) and what benchmarks compare it with (``acarerank.benchmark.baselines``
runs it as baseline (a)) — the one copy of the card's scoring path in the package. Beyond
the card: :func:`joint_input_ids`, and ``question``/``trace`` of
:func:`official_batch_input_ids`, apply the card's construction to the ACARe context modes.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

from .._validate import positive_int
from .pointwise import (DEFAULT_INSTRUCTION, DEFAULT_MAX_LENGTH, DEFAULT_TEMPLATE, QWEN3_RERANKER_BODY,
                        QWEN3_RERANKER_PREFIX, QWEN3_RERANKER_SUFFIX, ContextTemplate, body_text, check_documents,
                        check_query)


def official_format_instruction(instruction: Optional[str], query: str, doc: str) -> str:
    """The model card's ``format_instruction``: the body for one (query, document) pair."""
    if instruction is None:
        instruction = DEFAULT_INSTRUCTION
    return QWEN3_RERANKER_BODY.format(instruction=instruction, query=query, doc=doc)


def official_batch_input_ids(tokenizer, query: str, documents: Sequence[str], instruction: Optional[str] = None,
                             max_length: int = DEFAULT_MAX_LENGTH, question: Optional[str] = None,
                             trace: Optional[str] = None) -> List[List[int]]:
    """The model card's ``process_inputs`` before padding: one list of ids per document.

    The bodies go through one batched tokenizer call with the card's arguments (default
    ``add_special_tokens``, ``truncation='longest_first'`` from the right, i.e. the body's end
    — the document's tail — goes first). M0 (no question, no trace): the card's own body
    (``official_format_instruction``); M1–M3: the card's construction around ACARe's body
    (``body_text``), as the pointwise benchmark's baseline (a) runs it.
    """
    query = check_query(query)
    docs = check_documents(documents)
    prefix_tokens = tokenizer.encode(QWEN3_RERANKER_PREFIX, add_special_tokens=False)
    suffix_tokens = tokenizer.encode(QWEN3_RERANKER_SUFFIX, add_special_tokens=False)
    body_max = max_length - len(prefix_tokens) - len(suffix_tokens)
    if body_max < 1:
        raise ValueError(f"max_length={max_length} leaves no room for the body after prefix "
                         f"{len(prefix_tokens)} + suffix {len(suffix_tokens)} tokens")
    if question is None and trace is None:
        pairs = [official_format_instruction(instruction, query, doc) for doc in docs]
    else:
        pairs = [body_text(query, doc, question, trace, instruction) for doc in docs]
    inputs = tokenizer(pairs, padding=False, truncation="longest_first", return_attention_mask=False,
                       max_length=body_max)
    return [prefix_tokens + list(ele) + suffix_tokens for ele in inputs["input_ids"]]


def official_input_ids(tokenizer, query: str, doc: str, instruction: Optional[str] = None,
                       max_length: int = DEFAULT_MAX_LENGTH) -> List[int]:
    """One document's ids exactly as the model card builds them (M0: Qwen3-Reranker's prompt)."""
    if not isinstance(doc, str):
        raise TypeError(f"doc must be a str, got {type(doc).__name__}")
    return official_batch_input_ids(tokenizer, query, [doc], instruction, max_length)[0]


def joint_input_ids(tokenizer, query: str, doc: str, question: Optional[str] = None, trace: Optional[str] = None,
                    instruction: Optional[str] = None, template: ContextTemplate = DEFAULT_TEMPLATE) -> List[int]:
    """The card's construction for any ACARe mode, untruncated: ``tokens(prefix) + tokens(body) + tokens(suffix)``.

    The body is the whole mode body (context lines included) tokenized on its own, as the card
    tokenizes its body. This is the joint tokenization the prefix-sharing split must reproduce.
    """
    body = body_text(query, doc, question, trace, instruction, template)
    prefix_ids, body_ids, suffix_ids = tokenizer([QWEN3_RERANKER_PREFIX, body, QWEN3_RERANKER_SUFFIX],
                                                 add_special_tokens=False)["input_ids"]
    return list(prefix_ids) + list(body_ids) + list(suffix_ids)


def left_pad(input_ids: Sequence[Sequence[int]], pad_id: int, device=None):
    """Left-pad like the card's tokenizer (``padding_side='left'``): (input_ids, attention_mask), int64 [B, L]."""
    import torch

    if len(input_ids) == 0:
        raise ValueError("no sequences to pad")
    width = max(len(x) for x in input_ids)
    ids = torch.full((len(input_ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(input_ids), width), dtype=torch.long)
    for i, seq in enumerate(input_ids):
        if len(seq) == 0:
            raise ValueError(f"sequence {i} is empty")
        ids[i, width - len(seq):] = torch.as_tensor(list(seq), dtype=torch.long)
        mask[i, width - len(seq):] = 1
    return ids.to(device), mask.to(device)


def official_scores(model, tokenizer, input_ids: Sequence[Sequence[int]], batch_size: int = 4,
                    logits_to_keep: Optional[int] = 1) -> List[float]:
    """The card's ``compute_logits`` over left-padded batches: P(yes) = softmax([l_no, l_yes])[1] per sequence.

    Args:
        model: a transformers causal LM (e.g. ``Qwen3ForCausalLM``), eval mode.
        tokenizer: gives the yes/no ids (``convert_tokens_to_ids``, as the card) and the pad id.
        input_ids: one id list per document, e.g. from :func:`official_batch_input_ids`.
        batch_size: documents per forward (the pointwise benchmark's baseline uses 4).
        logits_to_keep: passed to the model so only the last position's logits are made
            (the card computes all and takes ``[:, -1]`` — the same row); ``None`` = all.

    Returns: list of float in [0, 1], input order. The card applies ``log_softmax`` in the
    model's dtype; we upcast the two logits to fp32 first (identical in fp32; in bf16 it keeps
    the oracle's own rounding out of the comparison).
    """
    import torch

    positive_int("batch_size", batch_size)
    yes_id = tokenizer.convert_tokens_to_ids("yes")
    no_id = tokenizer.convert_tokens_to_ids("no")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    device = next(model.parameters()).device
    extra = {} if logits_to_keep is None else {"logits_to_keep": logits_to_keep}
    scores: List[float] = []
    with torch.no_grad():
        for start in range(0, len(input_ids), batch_size):
            ids, mask = left_pad(input_ids[start:start + batch_size], pad_id, device=device)
            last = model(input_ids=ids, attention_mask=mask, **extra).logits[:, -1, :]
            pair = torch.stack([last[:, no_id], last[:, yes_id]], dim=1).float()
            scores.extend(torch.log_softmax(pair, dim=1)[:, 1].exp().tolist())
    return scores
