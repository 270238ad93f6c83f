"""Compiled kernels kept on disk, so that a process compiling what another one already compiled
loads its code instead. NVRTC takes most of a minute for the kernel files, and every test
worker, benchmark and server process compiles the files it launches.

An entry is named by the SHA-256 of everything that decides the code: the compiler and its
version, the whole option list (target, exactness flags, tuning macros) and the source with
its headers inlined. An edited kernel, option or compiler misses and compiles anew. A write
goes to a temporary file in the same folder and is renamed into place, so a reader never sees
part of an entry; a folder that cannot be written only costs the next process a compile.
DS4REF_KERNEL_CACHE names the folder ("off": no cache)."""
from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Callable, Optional, Sequence

from ..settings import getenv


def cache_dir() -> Optional[Path]:
    where = getenv("DS4REF_KERNEL_CACHE")
    if where == "off":
        return None
    return Path(where).expanduser() if where else Path.home() / ".cache" / "ds4ref" / "kernels"


def entry_name(compiler: str, options: Sequence[str], source: str) -> str:
    h = hashlib.sha256()
    for part in (compiler, *options, source):
        h.update(part.encode())
        h.update(b"\0")  # separators: ("ab", "c") and ("a", "bc") are different entries
    return h.hexdigest() + ".bin"


def compiled(compiler: str, options: Sequence[str], source: str, build: Callable[[], bytes]) -> bytes:
    """The code build() makes for this source and these options: the cached copy when an earlier
    build left one, else build()'s, which is then cached."""
    folder = cache_dir()
    if folder is None:
        return build()
    path = folder / entry_name(compiler, options, source)
    try:
        code = path.read_bytes()
        if code:
            return code
    except OSError:
        pass
    code = build()
    tmp = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(code)
        os.replace(tmp, path)
        tmp = None
    except OSError:
        pass
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
    return code
