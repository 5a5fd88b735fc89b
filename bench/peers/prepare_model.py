"""Write the model folder the peer servers load: the same weights acarerank serves.

    python bench/peers/prepare_model.py --out DIR [--preset tiny-cpu] [--seed 0]   # the embedded default
    python bench/peers/prepare_model.py --out DIR --model SRC                      # any HF checkpoint folder

The folder gets ``config.json`` + ``model.safetensors`` (the seeded random model that
``acarerank serve`` builds with no ``--model``, or links to SRC's files), the Qwen3 tokenizer
files when SRC has none, a ``README.md`` whose title names it a Qwen3-Reranker (llama.cpp's
converter recognises the reranker by it), and ``qwen3_reranker.jinja``: the model card's prompt
as a chat template for vLLM's score API. Jinja drops a template's final newline, and the model
card's suffix ends in two (``</think>\\n\\n``), so the suffix is written as a string expression;
losing it moved scores by ~0.1.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

TEMPLATE = (
    "{{- '<|im_start|>system\\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    "provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\\n<|im_start|>user\\n' -}}\n"
    "{{- '<Instruct>: ' ~ (messages | selectattr('role', 'eq', 'system') | map(attribute='content') | first "
    "| default('{instruction}')) ~ '\\n' -}}\n"
    "{{- '<Query>: ' ~ (messages | selectattr('role', 'eq', 'query') | map(attribute='content') | first) ~ '\\n' -}}\n"
    "{{- '<Document>: ' ~ (messages | selectattr('role', 'eq', 'document') | map(attribute='content') | first) -}}\n"
    "{{- '<|im_end|>\\n<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' -}}\n"
)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="folder to write (created; existing files are replaced)")
    ap.add_argument("--model", default=None, help="an HF checkpoint folder to serve instead of the embedded default")
    ap.add_argument("--preset", default="tiny-cpu", help="shape of the embedded default (acarerank.model.default)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the embedded default's weights (acarerank's is 0)")
    args = ap.parse_args(argv)

    from acarerank.model.default import PRESETS, build_default_model
    from acarerank.prompts.pointwise import DEFAULT_INSTRUCTION
    from acarerank.tokenizer import qwen3_tokenizer_dir

    os.makedirs(args.out, exist_ok=True)
    if args.model:
        if not os.path.isfile(os.path.join(args.model, "config.json")):
            print(f"prepare_model: --model {args.model!r} has no config.json", file=sys.stderr)
            return 2
        for name in os.listdir(args.model):  # link, never copy, the (possibly large) weights
            src, dst = os.path.abspath(os.path.join(args.model, name)), os.path.join(args.out, name)
            if os.path.isfile(src) and not os.path.exists(dst):
                os.symlink(src, dst)
    else:
        if args.preset not in PRESETS:
            print(f"prepare_model: unknown preset {args.preset!r}; presets: {', '.join(PRESETS)}", file=sys.stderr)
            return 2
        build_default_model(args.preset, seed=args.seed).save_pretrained(args.out)
    if not os.path.isfile(os.path.join(args.out, "tokenizer.json")):
        tok_dir = qwen3_tokenizer_dir()
        for name in os.listdir(tok_dir):
            shutil.copy(os.path.join(tok_dir, name), os.path.join(args.out, name))
    readme = os.path.join(args.out, "README.md")
    if not os.path.exists(readme):
        with open(readme, "w") as f:
            what = f"--model {args.model}" if args.model else f"preset {args.preset}, seed {args.seed}, RANDOM weights"
            f.write(f"# Qwen3-Reranker (acarerank benchmark copy: {what})\n")
    with open(os.path.join(args.out, "qwen3_reranker.jinja"), "w") as f:
        f.write(TEMPLATE.replace("{instruction}", DEFAULT_INSTRUCTION))
    with open(os.path.join(args.out, "config.json")) as f:
        cfg = json.load(f)
    print(f"{args.out}: {cfg.get('architectures')} hidden {cfg.get('hidden_size')} layers {cfg.get('num_hidden_layers')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
