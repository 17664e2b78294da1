"""Tokenizers (transformers) with their chat template, and the token ids that end a reply.

A GGUF carries its tokenizer as metadata; transformers builds a fast tokenizer from it
(`AutoTokenizer.from_pretrained(dir, gguf_file=name)`), which takes seconds and, in transformers
5.x, needs torch. The result is saved once under the jaxspec cache (`$JAXSPEC_CACHE_DIR`, else
`$XDG_CACHE_HOME/jaxspec`, else `~/.cache/jaxspec`) and reloaded from there in well under a second.
Without torch, the same transformers converter is driven from the metadata directly.
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import tempfile
import warnings
from pathlib import Path

from jaxspec.errors import JaxspecError
from jaxspec import validate
from jaxspec.loading.gguf_file import metadata
from jaxspec.paths import cache_root

# End-of-turn markers of common chat templates; one counts as a stop token when the model's
# template uses it and the vocabulary has it as a single token.
TURN_END_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@contextlib.contextmanager
def quiet():
    """Silence transformers' logging and Python warnings while building a tokenizer."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)


def load_dir_tokenizer(path: Path):
    """The tokenizer of an HF checkpoint directory, or None when the directory has none.
    Never runs code from the checkpoint (`trust_remote_code=False`; an `auto_map` is refused)."""
    present = [f for f in _TOKENIZER_FILES if (path / f).exists() or (path / f).is_symlink()]
    if not present:
        return None
    for name in present:
        validate.regular_file(path / name, name, validate.MAX_TOKENIZER_BYTES)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (path / name).exists():
            check_tokenizer_config(validate.read_json(path / name, name), path / name)
    from transformers import AutoTokenizer

    try:
        with quiet():
            tok = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 -- transformers / tokenizers raise many types on bad files
        raise JaxspecError(
            f"cannot load the tokenizer in {path} ({type(e).__name__}: "
            f"{validate.short(str(e).splitlines()[0] if str(e) else '')}): fix or re-download "
            f"its tokenizer files"
        ) from None
    return tok


def check_tokenizer_config(cfg: dict, source: Path) -> None:
    """Refuse what would run checkpoint code or break later: `auto_map` (custom tokenizer
    classes), a chat template that is not text, special tokens of the wrong type."""
    if "auto_map" in cfg:
        raise JaxspecError(
            f"{source}: auto_map names custom tokenizer code, and jaxspec never runs code from a "
            f"checkpoint: remove auto_map (use a standard tokenizer class) or convert the tokenizer"
        )
    f = validate.Fields(cfg, str(source))
    template = cfg.get("chat_template")
    if template is not None and not isinstance(template, str):
        ok = isinstance(template, list) and all(
            isinstance(t, dict) and isinstance(t.get("template"), str) for t in template
        )
        if not ok:
            f.fail("chat_template", template, "use a Jinja template string")
    for key in ("eos_token", "bos_token", "pad_token", "unk_token"):
        value = cfg.get(key)
        if value is not None and not isinstance(value, (str, dict)):
            f.fail(key, value, "use a token string")
    if f.given("tokenizer_class"):
        f.str("tokenizer_class")


def load_gguf_tokenizer(path: Path, reader, *, use_cache: bool = True):
    """The tokenizer described by a GGUF's metadata (None if it has none), chat template attached."""
    if "tokenizer.ggml.model" not in reader.fields:
        return None
    from transformers import AutoTokenizer

    cache = _cache_dir(path) if use_cache else None
    if cache is not None and (cache / "tokenizer_config.json").is_file():
        try:
            with quiet():
                return AutoTokenizer.from_pretrained(cache, trust_remote_code=False)
        except Exception:  # noqa: BLE001 — a damaged cache entry: rebuild it below
            shutil.rmtree(cache, ignore_errors=True)
    try:
        with quiet():
            tok = AutoTokenizer.from_pretrained(
                path.parent, gguf_file=path.name, trust_remote_code=False
            )
    except ImportError:  # transformers' GGUF reader imports torch
        tok = _checked(tokenizer_from_metadata, reader, path)
    except Exception as e:  # noqa: BLE001 -- damaged tokenizer metadata
        raise JaxspecError(
            f"{path}: its tokenizer metadata cannot be read ({type(e).__name__}: "
            f"{validate.short(str(e))}): re-download or re-convert the file"
        ) from None
    template = metadata(reader, "tokenizer.chat_template", None)
    if template is not None and not isinstance(template, str):
        raise JaxspecError(f"{path}: tokenizer.chat_template is not text: re-convert the file")
    if template and not tok.chat_template:
        tok.chat_template = template
    if cache is not None:
        _save(tok, cache)
    return tok


def _checked(build, reader, path):
    try:
        return build(reader)
    except JaxspecError:
        raise
    except Exception as e:  # noqa: BLE001 -- damaged tokenizer metadata
        raise JaxspecError(
            f"{path}: its tokenizer metadata cannot be read ({type(e).__name__}: "
            f"{validate.short(str(e))}): re-download or re-convert the file"
        ) from None


def tokenizer_from_metadata(reader):
    """Build the tokenizer from GGUF metadata with transformers' own converter, without torch."""
    from transformers import PreTrainedTokenizerFast

    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            _SPECIAL_TOKENS,
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )
    except ImportError:  # transformers 4.x
        from transformers.integrations.ggml import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

        _SPECIAL_TOKENS = {
            "bos_token": "bos_token_id",
            "eos_token": "eos_token_id",
            "unk_token": "unknown_token_id",
            "pad_token": "padding_token_id",
        }

    def group(name):
        out = {}
        for key, ours in GGUF_TOKENIZER_MAPPING[name].items():
            value = metadata(reader, f"tokenizer.{key}", None)
            if value is not None:
                out[ours] = value
        return out

    tokenizer_dict, config = group("tokenizer"), group("tokenizer_config")
    if tokenizer_dict.get("tokenizer_type") == "llama":
        config.setdefault("add_bos_token", True)
    for name, key in _SPECIAL_TOKENS.items():
        token_id = metadata(reader, f"tokenizer.ggml.{key}", None)
        config[name] = tokenizer_dict["tokens"][token_id] if token_id is not None else None
    with quiet():
        backend, extra = convert_gguf_tokenizer(
            metadata(reader, "general.architecture"), tokenizer_dict
        )
        return PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra)


def stop_token_ids(tokenizer, extra_ids=()) -> tuple[int, ...]:
    """EOS, the given ids (config / generation_config / GGUF eos+eot), and template turn ends."""
    ids = [i for i in extra_ids if i is not None]
    if tokenizer is not None:
        if tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
        template = tokenizer.chat_template or ""
        if isinstance(template, dict):
            template = "\n".join(template.values())
        for token in TURN_END_TOKENS:
            if token in template:
                token_id = tokenizer.convert_tokens_to_ids(token)
                if token_id is not None and tokenizer.convert_ids_to_tokens(token_id) == token:
                    ids.append(token_id)
    return tuple(dict.fromkeys(int(i) for i in ids))


def _cache_dir(path: Path) -> Path | None:
    import transformers

    try:
        st = path.stat()
    except OSError:
        return None
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root() / "tokenizers" / f"{path.stem}-{digest}"


def _save(tok, cache: Path) -> None:
    """Write to a temp dir, then rename: a concurrent reader sees all of it or nothing."""
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=cache.parent, prefix=".tmp-"))
        with quiet():
            tok.save_pretrained(tmp)
        try:
            tmp.rename(cache)
        except OSError:  # another process got there first
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError:  # read-only home etc.: just don't cache
        pass


def encode_prompt(tokenizer, prompt: str, messages: list | None = None) -> list[int]:
    """Token ids of `prompt` (through the chat template when `messages` is given). Text that is
    not valid Unicode, or a template the Jinja sandbox refuses, is a one-line JaxspecError."""
    check_text(prompt, "prompt")
    try:
        if messages is not None:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
        else:
            ids = tokenizer.encode(prompt)
    except Exception as e:  # noqa: BLE001 -- jinja2 SecurityError / TemplateError and the like
        import jinja2

        if not isinstance(e, jinja2.TemplateError):
            raise
        raise JaxspecError(
            f"the tokenizer's chat template failed ({type(e).__name__}: {validate.short(str(e))}): "
            f"fix chat_template in the checkpoint's tokenizer_config.json, or turn the template "
            f"off (generation.chat_template: false)"
        ) from None
    return [int(t) for t in ids]


def check_text(text: str, what: str) -> None:
    """Refuse text that cannot be encoded as UTF-8 (lone surrogates, undecodable argv bytes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise JaxspecError(
            f"{what} holds characters that are not valid Unicode (at position {e.start}): pass "
            f"UTF-8 text"
        ) from None
