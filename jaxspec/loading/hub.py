"""Hugging Face Hub ids -> a snapshot directory in the hub cache, fetching only what jaxspec reads.

    parse("Qwen/Qwen3-1.7B@main")        -> HubId(repo_id="Qwen/Qwen3-1.7B", revision="main")
    parse("org/name-GGUF/m.Q4_K_M.gguf") -> HubId(..., gguf_file="m.Q4_K_M.gguf")
    snap = fetch(hub_id, purpose="model", dtype="bfloat16")  # snap.path, snap.commit

An id is `org/name`, `org/name@revision` (a branch, tag or commit) and, for a repo of GGUF files,
`org/name[@revision]/FILE.gguf`. Callers try a local path first (one that exists wins) and short
names next; only what is left and reads as an id comes here.

What is fetched: config and generation config, tokenizer and chat-template files, `*.safetensors`
with their index, or one `.gguf`; for a drafter also jaxspec's own checkpoint files (meta.json and
its orbax `params/`). Never pickles (`.bin`, `.pt`, `.pth`, `.pkl`, `.ckpt`) and never code
(`*.py`): a repo that has only pickled weights is refused before any file is requested.

Order of work, so that every refusal comes before a byte of weights moves: one listing request
(`HfApi.model_info(files_metadata=True)`: commit, file names, sizes) -> choose the files -> for a
model, price the weights in the chosen dtype against what the device can hold (config.json is the
only file read for that) -> `snapshot_download(allow_patterns=the chosen names)`, which writes
into the cache atomically (a file appears under its final name only when complete; a failed run
leaves no partial file) and resumes a cut connection from the last whole chunk it wrote (a Range
request, in the same run). Progress (bytes, total, rate) goes to stderr when jaxspec's progress
lines are on (the default; off with --quiet, JAXSPEC_PROGRESS=0 or the `jaxspec` logger). The environment is read at each call,
not at import: `HF_ENDPOINT`, `HF_HOME` / `HF_HUB_CACHE`, `HF_TOKEN`, `HF_HUB_OFFLINE` (offline:
the cache only, no request at all).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import re
import threading
import time
from pathlib import Path
from typing import Literal

from jaxspec import progress
from jaxspec import limits
from jaxspec.errors import JaxspecError
from jaxspec.loading.params import load_peak_bytes
from jaxspec.loading.safetensors_dir import config_from_hf

# A repo id: two segments of letters, digits, '-', '_', '.', neither starting with '.' or '-'.
_SEGMENT = r"[A-Za-z0-9_][\w.-]{0,95}"
_ID = re.compile(
    rf"(?P<repo>{_SEGMENT}/{_SEGMENT})(?:@(?P<revision>[\w.-]+(?:/[\w.-]+)*?))?"
    r"(?:/(?P<gguf>[^/\\]+\.gguf))?"
)

CONFIG_FILES = ("config.json", "generation_config.json", "params.json")
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
)
DRAFTER_FILES = ("meta.json",)  # + params/** (jaxspec's orbax checkpoint), see `_wanted`
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
Purpose = Literal["model", "drafter"]

FETCHED: dict[str, str] = {}  # id as given -> resolved commit, for every fetch of this process


@dataclasses.dataclass(frozen=True, kw_only=True)
class HubId:
    repo_id: str
    revision: str | None = None  # None: the repo's default branch
    gguf_file: str | None = None

    def __str__(self) -> str:
        rev = f"@{self.revision}" if self.revision else ""
        return f"{self.repo_id}{rev}" + (f"/{self.gguf_file}" if self.gguf_file else "")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Snapshot:
    path: Path  # the snapshot directory (files are links into the cache's blobs)
    commit: str  # the 40-hex commit the revision resolved to
    files: tuple[str, ...]  # what jaxspec fetched (or found cached) there
    gguf_file: str | None = None  # the .gguf to load, for a GGUF repo


def parse(text: str) -> HubId | None:
    """The id `text` spells, or None when it is not one (a path, a short name)."""
    m = _ID.fullmatch(text.strip())
    if m is None or ".." in text or m["repo"].endswith(".gguf"):
        return None
    return HubId(repo_id=m["repo"], revision=m["revision"], gguf_file=m["gguf"])


def fetch(
    hub_id: HubId,
    *,
    purpose: Purpose = "model",
    dtype: str | None = None,
    free_bytes: int | None = None,
) -> Snapshot:
    """Download (or find cached) what jaxspec reads of `hub_id`; every failure is one line.

    `dtype` (model only): the weights are priced in it before downloading and refused when they
    exceed `free_bytes` (None: what `limits.free_memory_bytes` measures, times its headroom)."""
    import huggingface_hub as hf

    cache_dir = _cache_dir()
    if _offline():
        return _cached(hub_id, purpose, cache_dir, reason="HF_HUB_OFFLINE is set")
    api = hf.HfApi(endpoint=_endpoint())
    try:
        info = api.model_info(hub_id.repo_id, revision=hub_id.revision, files_metadata=True,
                              timeout=hf.constants.HF_HUB_ETAG_TIMEOUT)  # no silent hang
    except Exception as e:  # noqa: BLE001 -- mapped to one line, or the cache when unreachable
        if _unreachable(e):
            return _cached(hub_id, purpose, cache_dir, reason=f"the Hub is unreachable ({_why(e)})")
        raise _hub_error(e, hub_id) from None
    sizes = {s.rfilename: (s.size or 0) for s in info.siblings or ()}
    files, weights = choose_files(hub_id, sizes, purpose)
    if purpose == "model" and dtype is not None:
        estimate = _estimate_bytes(hub_id, info.sha, sizes, weights, dtype, cache_dir)
        check_fits(hub_id, estimate, dtype, free_bytes)
    path = _download(hub_id, files, cache_dir, sum(sizes[f] for f in files))
    return _snapshot(hub_id, Path(path), files)


def choose_files(
    hub_id: HubId, sizes: dict[str, int], purpose: Purpose = "model"
) -> tuple[list[str], list[str]]:
    """(files to fetch, the weight files among them) from the repo's listing `sizes`
    (name -> bytes), or a one-line refusal (pickles only, no weights, an unnamed or missing
    .gguf)."""
    names = sorted(sizes)
    top = [n for n in names if "/" not in n]  # subfolders (original/, onnx/ ...) are other formats
    gguf = [n for n in top if n.endswith(".gguf")]
    st = [n for n in top if n.endswith(".safetensors")]
    if len(st) > 1:  # Mistral ships consolidated.safetensors next to the HF shards
        st = [n for n in st if not n.startswith("consolidated")] or st
    own = purpose == "drafter" and "meta.json" in names  # a jaxspec checkpoint (orbax params/)
    if hub_id.gguf_file is not None:
        if hub_id.gguf_file not in names:
            raise JaxspecError(
                f"{hub_id.repo_id} has no file {hub_id.gguf_file}: its .gguf files are "
                f"{_few(gguf) or 'none'}"
            )
        weights = [hub_id.gguf_file]
    elif st:
        weights = st + [n for n in top if n.endswith(".safetensors.index.json")]
    elif own:
        weights = [n for n in names if n.startswith("params/")]
    elif len(gguf) == 1:
        weights = gguf
    elif gguf:
        raise JaxspecError(
            f"{hub_id.repo_id} holds {len(gguf)} .gguf files: name one, e.g. "
            f"{hub_id}/{gguf[0]} (others: {_few(gguf[1:])})"
        )
    else:
        pickled = [n for n in names if n.endswith(PICKLE_SUFFIXES)]
        if pickled:
            raise JaxspecError(
                f"{hub_id.repo_id} has only pickled weights ({_few(pickled)}), which jaxspec never "
                f"downloads or loads (a pickle runs code): use a repo with .safetensors or .gguf "
                f"weights, or convert them yourself and pass the directory"
            )
        raise JaxspecError(
            f"{hub_id.repo_id} has no .safetensors or .gguf weights jaxspec can read "
            f"(files: {_few(names) or 'none'})"
        )
    # a .gguf carries its own tokenizer and config: the repo's config files only ride along
    extra = CONFIG_FILES + (() if weights[0].endswith(".gguf") else TOKENIZER_FILES)
    if purpose == "drafter":
        extra += DRAFTER_FILES
    wanted = set(weights) | {n for n in top if n in extra}
    return sorted(n for n in wanted if not n.endswith(".py")), weights


def check_fits(hub_id: HubId, estimate: int, dtype: str, free_bytes: int | None = None) -> None:
    """A one-line refusal when `estimate` bytes (the weights in `dtype`) exceed what the device
    can hold (`free_bytes`; None: measured), said before anything is downloaded."""
    where = "the given memory"
    if free_bytes is None:
        free, where = limits.free_memory_bytes()
        if free is None:
            return
        free_bytes = int(free * limits.MEMORY_HEADROOM)
    if estimate > free_bytes:
        raise JaxspecError(
            f"{hub_id} needs about {_gb(estimate)} in {dtype} but {where} has {_gb(free_bytes)} "
            f"free: nothing was downloaded; pick a smaller model, a smaller dtype "
            f"(model.dtype=bfloat16) or shard it over more devices (mesh.*)"
        )


def _estimate_bytes(hub_id, commit, sizes, weights, dtype, cache_dir) -> int:
    """The loader's estimate (`params.load_peak_bytes`) from config.json when its family is the
    Llama one; else the weight bytes rescaled from the stored dtype to `dtype`."""
    import numpy as np
    import jax.numpy as jnp

    stored = sum(sizes.get(w, 0) for w in weights if not w.endswith(".json"))
    if "config.json" not in sizes or weights[0].endswith(".gguf"):
        return stored  # quantized GGUF: the dequantized params are larger still (a lower bound)
    import huggingface_hub as hf

    try:
        config = hf.hf_hub_download(
            hub_id.repo_id, "config.json", revision=commit, cache_dir=cache_dir,
            endpoint=_endpoint(),
        )
        hf_config = json.loads(Path(config).read_text())
    except Exception as e:  # noqa: BLE001 -- one small file: the same mapping as the listing
        raise _hub_error(e, hub_id) from None
    try:
        cfg = config_from_hf(hf_config, dtype=dtype, source=f"{hub_id}/config.json")
        return load_peak_bytes(cfg, dtype)["peak"]
    except Exception:  # noqa: BLE001 -- another family: by bytes
        stored_dtype = hf_config.get("torch_dtype") or hf_config.get("dtype") or "bfloat16"
        try:
            ratio = np.dtype(jnp.dtype(dtype)).itemsize / np.dtype(jnp.dtype(stored_dtype)).itemsize
        except TypeError:
            ratio = 1.0
        return int(stored * ratio)


def _download(hub_id: HubId, files: list[str], cache_dir: str | None, total: int) -> str:
    import huggingface_hub as hf

    note = progress.start(f"downloading {hub_id} ({len(files)} files, {_gb(total)})")
    count = _ByteCount(hub_id, total)
    try:
        path = hf.snapshot_download(
            hub_id.repo_id,
            revision=hub_id.revision,
            allow_patterns=files,
            cache_dir=cache_dir,
            endpoint=_endpoint(),
            tqdm_class=count.bar_class(),
        )
    except OSError as e:
        note("failed")
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise JaxspecError(
                f"disk full while downloading {hub_id} into "
                f"{cache_dir or hf.constants.HF_HUB_CACHE} ({_gb(total)} needed): free space or "
                f"point HF_HOME at a larger disk; the cache keeps no partial file"
            ) from None
        raise _hub_error(e, hub_id) from None
    except Exception as e:  # noqa: BLE001
        note("failed")
        raise _hub_error(e, hub_id) from None
    note(f"{_gb(count.done)} received, {count.rate()}; done")
    return path


def _cached(hub_id: HubId, purpose: Purpose, cache_dir: str | None, *, reason: str) -> Snapshot:
    """The snapshot already in the cache, with no request made."""
    import huggingface_hub as hf

    try:  # the listing cached with the snapshot: the same choice of files as online
        tree = hf.get_cached_repo_tree(
            hub_id.repo_id, revision=hub_id.revision, cache_dir=cache_dir
        )
        patterns = choose_files(hub_id, {f.path: f.size or 0 for f in tree}, purpose)[0]
    except Exception:  # noqa: BLE001 -- no listing cached: whatever the snapshot holds
        patterns = None
    try:
        path = hf.snapshot_download(
            hub_id.repo_id, revision=hub_id.revision, cache_dir=cache_dir,
            local_files_only=True, allow_patterns=patterns,
        )
    except Exception:  # noqa: BLE001 -- not cached, or cached incompletely
        raise JaxspecError(
            f"{reason} and {hub_id} is not (completely) in the Hugging Face cache "
            f"({cache_dir or hf.constants.HF_HUB_CACHE}): run once with network access, or "
            f"`hf download {hub_id.repo_id}"
            + (f" --revision {hub_id.revision}" if hub_id.revision else "")
            + "` where there is, and copy HF_HOME over"
        ) from None
    path = Path(path)
    files = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())
    return _snapshot(hub_id, path, files)


def _snapshot(hub_id: HubId, path: Path, files) -> Snapshot:
    gguf = hub_id.gguf_file
    if gguf is None and not any(f.endswith(".safetensors") for f in files):
        ggufs = [f for f in files if f.endswith(".gguf")]
        gguf = ggufs[0] if len(ggufs) == 1 else None
    FETCHED[str(hub_id)] = path.name
    return Snapshot(path=path, commit=path.name, files=tuple(files), gguf_file=gguf)


def _hub_error(e: Exception, hub_id: HubId) -> JaxspecError:
    """One line for what the Hub answered (the huggingface_hub error classes)."""
    from huggingface_hub import errors

    url = f"{_endpoint() or 'https://huggingface.co'}/{hub_id.repo_id}"
    status = getattr(getattr(e, "response", None), "status_code", None)
    if isinstance(e, errors.GatedRepoError) or (
        status in (401, 403) and not isinstance(e, errors.RepositoryNotFoundError)
    ):
        return JaxspecError(
            f"{hub_id.repo_id} is gated or private (HTTP {status}): accept its license at {url} "
            f"and set HF_TOKEN to an access token of that account (or run `hf auth login`)"
        )
    if isinstance(e, errors.RevisionNotFoundError):
        return JaxspecError(
            f"{hub_id.repo_id} has no revision '{hub_id.revision}': use a branch, tag or commit "
            f"listed at {url}/commits/main"
        )
    if isinstance(e, errors.RepositoryNotFoundError):
        return JaxspecError(
            f"no model {hub_id.repo_id} on the Hub ({url}): check the id; for a private repo set "
            f"HF_TOKEN (or run `hf auth login`); for a local directory, check the path"
        )
    return JaxspecError(
        f"downloading {hub_id} failed ({_why(e)}): run the same command again; finished files "
        f"are kept and the cache never keeps a partial one"
    )


def _unreachable(e: Exception) -> bool:
    """No answer from the Hub (by class name: huggingface_hub's HTTP stack is httpx2, httpx or
    requests depending on its version)."""
    names = {c.__name__ for c in type(e).__mro__}
    return bool(names & {"ConnectError", "TimeoutException", "ConnectionError", "Timeout",
                         "OfflineModeIsEnabled"})


def _why(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _offline() -> bool:
    from huggingface_hub import constants

    flag = os.environ.get("HF_HUB_OFFLINE", "").strip().upper()
    return flag in ("1", "ON", "YES", "TRUE") or bool(constants.HF_HUB_OFFLINE)


def _endpoint() -> str | None:
    return os.environ.get("HF_ENDPOINT", "").rstrip("/") or None


def _cache_dir() -> str | None:
    """HF_HUB_CACHE, else HF_HOME/hub, read now (huggingface_hub reads them once, at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    return None


class _ByteCount:
    """Bytes received so far by every file of one download (updated from the hub's threads)."""

    def __init__(self, hub_id: HubId, total: int):
        self.hub_id, self.total, self.done = hub_id, total, 0
        self.start = self.last = time.perf_counter()
        self.lock = threading.Lock()

    def add(self, n: int) -> None:
        with self.lock:
            self.done += n
            now = time.perf_counter()
            if now - self.last >= 2.0:  # a line every 2 s at most: bytes, total, rate
                self.last = now
                progress.note(f"downloading {self.hub_id}: {_gb(self.done)} of "
                              f"{_gb(self.total)}, {self.rate()}")

    def rate(self) -> str:
        return f"{self.done / max(time.perf_counter() - self.start, 1e-6) / 1e6:.1f} MB/s"

    def bar_class(self):
        """A tqdm stand-in for `snapshot_download(tqdm_class=)`: its byte bars feed this count
        (the reconstruction bar repeats the transfer bar's bytes, so it is not counted)."""
        count = self

        class Bar:
            def __init__(self, *args, **kwargs):
                self.n, self.total = kwargs.get("initial") or 0, kwargs.get("total")
                desc = str(kwargs.get("desc") or "")
                self.counts = kwargs.get("unit") == "B" and "econstruct" not in desc
                self.format_dict: dict = {"rate": None}

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def update(self, n=1):
                self.n += n or 0
                if self.counts and n:
                    count.add(int(n))

            def noop(self, *args, **kwargs):
                return None

            close = refresh = set_description = set_description_str = set_postfix_str = noop

        return Bar


def _few(names: list[str], n: int = 3) -> str:
    more = f" and {len(names) - n} more" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"

