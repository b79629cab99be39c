"""Text files users hand in (prompts, scripts, configs, result rows): checked before they are read.

Invariant: a path is read only if it is a regular file (no directory, FIFO or device such as
/dev/zero) of at most `max_bytes`, and its bytes are valid UTF-8; otherwise a ValueError names
the flag and the problem.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


def read_text_file(path: str | Path, what: str, max_bytes: int) -> str:
    """The UTF-8 text of the regular file `path`, or ValueError naming `what` (e.g. `--prompt-file`)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO must not block the open
    except FileNotFoundError:
        raise ValueError(f"{what}: {path} does not exist") from None
    except OSError as exc:
        raise ValueError(f"{what}: cannot open {path}: {exc.strerror or exc}") from None
    st = os.fstat(fd)
    problem = (
        "is a directory, not a file"
        if stat.S_ISDIR(st.st_mode)
        else "is not a regular file"
        if not stat.S_ISREG(st.st_mode)
        else f"is {st.st_size:,} bytes, more than the {max_bytes:,} allowed"
        if st.st_size > max_bytes
        else None
    )
    if problem:
        os.close(fd)
        raise ValueError(f"{what}: {path} {problem}")
    with os.fdopen(fd, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ValueError(f"{what}: {path} grew past the {max_bytes:,} bytes allowed while being read")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{what}: {path} is not valid UTF-8 text (byte {exc.start})") from None
