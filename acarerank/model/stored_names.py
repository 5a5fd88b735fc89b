"""Stored tensors the model does not read: refused, warned about, or ignored.

transformers loads such a checkpoint with one "Some weights ... were not used" warning; here
(docs/input-safety.md, "Checkpoints are read exactly"):

* tensors of layers at or past ``num_hidden_layers``: CheckpointError — the config and the
  weights disagree, and the scores would come from fewer layers than were stored;
* adapter tensors (peft's ``lora_``, ``.base_layer.``, ``.modules_to_save.``,
  ``.original_module.``): CheckpointError — the adapter has to be merged into the weights first;
* rotary ``inv_freq`` buffers (older exports saved them): ignored, they are recomputed from the config;
* anything else: one UserWarning naming up to ``SHOWN`` of them and their count.
"""
from __future__ import annotations

import re
import warnings

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_ADAPTER = re.compile(r"lora_|\.base_layer\.|\.modules_to_save\.|\.original_module\.")
_HARMLESS = re.compile(r"(^|\.)rotary_emb\.(original_)?inv_freq$")
SHOWN = 10


def _listed(names: list) -> str:
    return f"{names[:SHOWN]}{' ...' if len(names) > SHOWN else ''}"


def refuse_foreign(names, num_layers: int, source: str, error=ValueError) -> None:
    """``error`` (a ValueError class) for adapter tensors or tensors of layers >= ``num_layers``."""
    adapter = sorted(n for n in names if _ADAPTER.search(n))
    if adapter:
        raise error(f"{source}: {len(adapter)} tensors of an unmerged adapter (LoRA / peft), e.g. {_listed(adapter)}; "
                    "merge the adapter into the weights first (peft's merge_and_unload(), then save_pretrained)")
    extra = sorted({int(m.group(1)) for m in map(_LAYER.match, names) if m and int(m.group(1)) >= num_layers})
    if extra:
        raise error(f"{source}: tensors of layers {extra[:SHOWN]}{' ...' if len(extra) > SHOWN else ''} but "
                    f"num_hidden_layers is {num_layers}: the config and the weights disagree, and the scores would "
                    "come from fewer layers than were stored; fix num_hidden_layers in config.json")


def warn_unused(names, used, source: str, stacklevel: int = 2) -> None:
    """One UserWarning naming the stored tensors not in ``used`` (rotary inv_freq buffers aside)."""
    unused = sorted(n for n in names if n not in used and not _HARMLESS.search(n))
    if unused:
        warnings.warn(f"{source}: {len(unused)} stored tensors are not used by a Qwen3 model with this config and "
                      f"were ignored (as transformers ignores them): {_listed(unused)}", stacklevel=stacklevel + 1)
