"""Peers: other projects' KV-cache methods run on our benchmark's exact task instances.

A peer spec names the project and its method:

- `kvpress:<press>:cr=<ratio>` — an NVIDIA kvpress press at a compression ratio (share of
  context entries removed). kvpress pins transformers < 5.3, so it runs in its own virtual
  environment (`kvstrata_lab.bench.peers.venv`) through a worker process that speaks JSON lines.
- `qcache:<backend>:int<bits>` — transformers' `QuantizedCache` with the `quanto` or `hqq`
  backend, run in this process.
- `llamacpp:<type>` (or `llamacpp:<k type>:v=<v type>`) — llama.cpp's KV cache of that type under
  `llama-server` (flash attention on), on the GGUF our model is converted from, with its quantized
  weights; built once from a pinned PyPI source package (`kvstrata_lab.bench.peers.llamacpp_build`).

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
#: llama.cpp's KV cache types and the bytes each stores per 32 values (its block layout: q4_0 is an
#: fp16 scale and 32 4-bit values, 18 bytes; q4_1 adds an fp16 minimum; q5 adds 4 bytes of high bits)
LLAMACPP_TYPES = {"f16": 64, "bf16": 64, "q8_0": 34, "q5_1": 24, "q5_0": 22, "q4_1": 20, "iq4_nl": 18,
                  "q4_0": 18}
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

    project: str  # "kvpress", "qcache" or "llamacpp"
    name: str  # press name or backend
    params: dict = field(default_factory=dict)

    @property
    def spec(self) -> str:
        if self.project == "kvpress":
            return f"kvpress:{self.name}:cr={self.params['cr']:g}"
        if self.project == "llamacpp":
            v = self.params["v"]
            return f"llamacpp:{self.name}" + ("" if v == self.name else f":v={v}")
        return f"qcache:{self.name}:int{self.params['bits']}"


def is_peer(spec: str) -> bool:
    return spec.split(":", 1)[0] in ("kvpress", "qcache", "llamacpp")


def parse_llamacpp(spec: str, parts: list[str]) -> PeerSpec:
    """`llamacpp:q4_0` (keys and values) or `llamacpp:q8_0:v=q4_0`."""
    known = ", ".join(LLAMACPP_TYPES)
    k = parts[1] if len(parts) > 1 else ""
    v = k
    if len(parts) == 3:
        key, _, v = parts[2].partition("=")
        if key != "v":
            raise ValueError(f"peer spec {spec!r}: expected llamacpp:<type>[:v=<type>]")
    for t in (k, v):
        if t not in LLAMACPP_TYPES:
            raise ValueError(f"peer spec {spec!r}: unknown llama.cpp KV cache type {t!r} (known: {known})")
    return PeerSpec("llamacpp", k, {"v": v})


def parse_peer(spec: str) -> PeerSpec:
    """`kvpress:snapkv:cr=0.72`, `qcache:quanto:int4` or `llamacpp:q4_0`; a clear error for anything else."""
    parts = spec.strip().split(":")
    if parts[0] == "llamacpp" and len(parts) in (2, 3):
        return parse_llamacpp(spec, parts)
    if len(parts) != 3:
        raise ValueError(f"peer spec {spec!r}: expected kvpress:<press>:cr=<ratio>, "
                         "qcache:<backend>:int<bits> or llamacpp:<type>")
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
    raise ValueError(f"peer spec {spec!r}: unknown peer project {project!r} (known: kvpress, qcache, "
                     "llamacpp)")
