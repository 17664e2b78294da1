"""Output directories jaxspec writes (trained drafters, exports): never destroy what jaxspec did
not create, and replace atomically.

A target that exists must be empty or a checkpoint jaxspec wrote (a drafter's `meta.json` with
format `jaxspec-drafter`, or an export's `.jaxspec-export` marker); replacing one of those needs
`force`. The current directory, its ancestors, the home directory and the file-system root are
always refused. The new content is written into a sibling temporary directory and renamed into
place, so an interrupted write leaves the old checkpoint (or nothing) behind, never half of one.
Files are created with the user's umask (temporary directories start as 0700).

    with replace_dir(out, force=args.force, what="--out") as tmp:
        write_files(tmp)          # tmp is renamed to `out` when the block succeeds
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

from jaxspec.errors import JaxspecError

EXPORT_MARKER = ".jaxspec-export"  # written into every export directory (servers ignore it)
DRAFTER_FORMAT = "jaxspec-drafter"


def is_jaxspec_output(path: Path) -> bool:
    """True when `path` holds a drafter checkpoint or an export that jaxspec wrote."""
    if (path / EXPORT_MARKER).is_file():
        return True
    meta = path / "meta.json"
    try:
        if not meta.is_file() or meta.stat().st_size > 1 << 24:
            return False
        return json.loads(meta.read_text()).get("format") == DRAFTER_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def check_output_dir(path, *, force: bool, what: str = "output directory") -> Path:
    """The absolute path, or a JaxspecError saying why jaxspec will not write there."""
    p = Path(os.path.abspath(Path(path).expanduser()))
    cwd = Path(os.path.abspath(os.getcwd()))
    protected = {Path(p.anchor), Path.home().absolute(), cwd, *cwd.parents}
    if p in protected:
        raise JaxspecError(
            f"{what} {path} is the current directory, one of its parents, the home directory or "
            f"the root: name a new directory for the output (e.g. out/my-drafter)"
        )
    if p.is_symlink() or (p.exists() and not p.is_dir()):
        raise JaxspecError(
            f"{what} {path} exists and is not a directory: name a new directory for the output"
        )
    if not p.exists():
        return p
    try:
        empty = not any(p.iterdir())
    except OSError as e:
        raise JaxspecError(f"{what} {path} cannot be listed ({e.strerror}): name another directory") from None
    if empty:
        return p
    if not is_jaxspec_output(p):
        raise JaxspecError(
            f"{what} {path} is not empty and is not a checkpoint jaxspec wrote: jaxspec never "
            f"replaces it; name a new directory (e.g. out/my-drafter)"
        )
    if not force:
        raise JaxspecError(
            f"{what} {path} already holds a jaxspec checkpoint: pass --force (force=true) to "
            f"replace it, or name a new directory"
        )
    return p


def current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(root: Path) -> None:
    """Give everything under `root` the modes a plain `open`/`mkdir` would have given it."""
    mask = current_umask()
    for dirpath, dirnames, filenames in os.walk(root):
        os.chmod(dirpath, 0o777 & ~mask)
        for name in filenames:
            f = Path(dirpath, name)
            if not f.is_symlink():
                os.chmod(f, 0o666 & ~mask)


@contextlib.contextmanager
def replace_dir(path, *, force: bool, what: str = "output directory", marker: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of `path` to write into; on success it becomes `path` (the old
    content, a jaxspec checkpoint when `force`, is removed only after the rename). `marker`:
    also write `.jaxspec-export`, so a later export may replace this one with force."""
    target = check_output_dir(path, force=force, what=what)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))
    try:
        yield tmp
        if marker:
            (tmp / EXPORT_MARKER).write_text("written by jaxspec; replaced only with --force\n")
        apply_umask(tmp)
        check_output_dir(target, force=force, what=what)  # still ours after the (long) write
        if target.exists():
            old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
            target.rename(old)
            tmp.rename(target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
