"""Peers: other projects' KV-cache methods run on our benchmark's exact task instances.

A peer spec names the project and its method:

- `kvpress:<press>:cr=<ratio>` — an NVIDIA kvpress press at a compression ratio (share of
  context entries removed). kvpress pins transformers < 5.3, so it runs in its own virtual
  environment (`kvstrata_lab.bench.peers.venv`) through a worker process that speaks JSON lines.
- `qcache:<backend>:int<bits>` — transformers' `QuantizedCache` with the `quanto` or `hqq`
  backend, run in this process.

Rows carry `family = "peer"` and `peer = "<project> <version>"`; a peer that fails on a model
writes a row with `error` (how it failed) instead of being dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: our short names -> kvpress class names (and the wrapper for head-wise presses)
PRESSES = {
    "streaming": "StreamingLLMPress",
    "snapkv": "SnapKVPress",
    "knorm": "KnormPress",
    "expected": "ExpectedAttentionPress",
    "tova": "TOVAPress",
    "pyramidkv": "PyramidKVPress",
    "kvzip": "KVzipPress",
    "adakv": "AdaKVPress(SnapKVPress)",
}
BACKENDS = ("quanto", "hqq")
KVPRESS_VERSION = "0.5.5"
KVPRESS_TRANSFORMERS = "5.2.0"

# compression ratio 0.72 keeps 0.28 of the context: the bytes of our FP4 rows (and of
# streaming/snapkv keep=0.28); 0.47 keeps 0.53 (fp8 and keep=0.53)
DEFAULT_PEERS = (
    *(f"kvpress:{p}:cr=0.72" for p in ("streaming", "snapkv",
      "knorm", "expected", "tova", "pyramidkv", "kvzip")),
    "kvpress:snapkv:cr=0.47",
    "qcache:quanto:int4", "qcache:quanto:int2", "qcache:hqq:int4", "qcache:hqq:int2",
)


@dataclass(frozen=True)
class PeerSpec:
    """A parsed peer spec; `spec` is its canonical text (the row's `method`)."""

    project: str  # "kvpress" or "qcache"
    name: str  # press name or backend
    params: dict = field(default_factory=dict)

    @property
    def spec(self) -> str:
        if self.project == "kvpress":
            return f"kvpress:{self.name}:cr={self.params['cr']:g}"
        return f"qcache:{self.name}:int{self.params['bits']}"


def is_peer(spec: str) -> bool:
    return spec.split(":", 1)[0] in ("kvpress", "qcache")


def parse_peer(spec: str) -> PeerSpec:
    """`kvpress:snapkv:cr=0.72` or `qcache:quanto:int4`; a clear error for anything else."""
    parts = spec.strip().split(":")
    if len(parts) != 3:
        raise ValueError(f"peer spec {spec!r}: expected kvpress:<press>:cr=<ratio> or "
                         "qcache:<backend>:int<bits>")
    project, name, arg = parts
    if project == "kvpress":
        if name not in PRESSES:
            raise ValueError(f"peer spec {spec!r}: unknown press {name!r} (known: {', '.join(PRESSES)})")
        key, _, value = arg.partition("=")
        try:
            cr = float(value)
        except ValueError:
            cr = -1.0
        if key != "cr" or not 0.0 <= cr < 1.0:
            raise ValueError(f"peer spec {spec!r}: expected cr=<ratio> with 0 <= ratio < 1 (share of entries "
                             "removed)")
        return PeerSpec(project, name, {"cr": cr})
    if project == "qcache":
        if name not in BACKENDS:
            raise ValueError(f"peer spec {spec!r}: unknown QuantizedCache backend {name!r} (known: "
                             f"{', '.join(BACKENDS)})")
        if arg not in ("int2", "int4"):
            raise ValueError(f"peer spec {spec!r}: bits must be int2 or int4")
        return PeerSpec(project, name, {"bits": int(arg[3:])})
    raise ValueError(f"peer spec {spec!r}: unknown peer project {project!r} (known: kvpress, qcache)")
