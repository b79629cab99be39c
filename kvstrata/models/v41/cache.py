"""`V41Cache`: what a V4.1 model keeps between forward passes, stored through kvstrata's codecs.

Per layer: its SWA window (FP8 by default, the last `sliding_window` positions, or fewer after a
bounded replay); for layers that own global KV, the compressed latents (FP4: E2M1 + E4M3 scale
per 16) and index keys (MXFP4), plus at most m - 1 projected positions waiting for their pair.
Reindex / Reuse layers store no global KV. `nbytes()` counts exactly what is held, the number
the accounting (`kvstrata accounting --preset …`) predicts.
"""

from __future__ import annotations

import torch
from transformers import Cache
from transformers.cache_utils import CacheLayerMixin

from kvstrata.codecs import QTensor, quantize


def _cat(a: QTensor | None, b: QTensor) -> QTensor:
    """Append encoded rows along the token axis (dim 1): every part keeps the leading dims."""
    if a is None:
        return b
    if a.spec != b.spec:
        raise ValueError(f"cannot append {b.spec} rows to {a.spec} rows")
    parts = {k: torch.cat([a.parts[k], b.parts[k]], dim=1) for k in a.parts}
    return QTensor(codec=a.codec, shape=(a.shape[0], a.shape[1] + b.shape[1], *a.shape[2:]), dtype=a.dtype,
                   parts=parts)


def _tail(a: QTensor, n: int) -> QTensor:
    """The last `n` rows along the token axis."""
    parts = {k: v[:, -n:].clone() if n else v[:, :0].clone() for k, v in a.parts.items()}
    return QTensor(codec=a.codec, shape=(a.shape[0], min(n, a.shape[1]), *a.shape[2:]), dtype=a.dtype,
                   parts=parts)


class Store:
    """Rows encoded with one codec (or kept as float when `spec` is None), appended over time."""

    def __init__(self, spec: str | None):
        self.spec = spec
        self.rows: QTensor | torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.rows is None else self.rows.shape[1]

    def append(self, x: torch.Tensor) -> None:
        if self.spec is None:
            self.rows = x if self.rows is None else torch.cat([self.rows, x], dim=1)
        else:
            self.rows = _cat(self.rows, quantize(x.float(), self.spec))

    def keep_last(self, n: int) -> None:
        if self.rows is not None and self.rows.shape[1] > n:
            self.rows = self.rows[:, -n:].clone() if self.spec is None else _tail(self.rows, n)

    def read(self, dtype: torch.dtype) -> torch.Tensor | None:
        if self.rows is None:
            return None
        return (self.rows if self.spec is None else self.rows.dequantize()).to(dtype)

    @property
    def nbytes(self) -> int:
        if self.rows is None:
            return 0
        return self.rows.nbytes if self.spec is not None else self.rows.numel() * self.rows.element_size()


class V41LayerCache(CacheLayerMixin):
    """One layer's held state; written by the model's attention, not by `update`."""

    def __init__(self, cfg, layer: int):
        super().__init__()
        q = cfg.quantize_cache
        self.owns = cfg.layer_modes[layer] == "full"
        self.swa = Store(cfg.swa_codec if q else None)
        #: pure-SWA layers of a `swa_values` model hold V rows apart from their K rows
        self.swa_v = Store(cfg.swa_codec if q else None) if cfg.separate_swa_v(layer) else None
        self.swa_pos0 = 0  # position of the first SWA row held
        self.latents = Store(cfg.global_codec if q else None)
        self.index_keys = Store(cfg.index_codec if q else None)
        self.pending: dict[str, torch.Tensor] = {}  # projections of positions waiting for their pair
        self.seen = 0
        self.window = cfg.sliding_window

    def lazy_initialization(self, key_states, value_states) -> None:
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        raise TypeError("V4.1 cache layers are written by the V4.1 attention (write_swa / write_global), not "
                        "update()")

    def write_swa(self, x: torch.Tensor, pos0: int, v: torch.Tensor | None = None) -> None:
        """Append SWA rows (and V rows, when held apart) for positions `pos0 …`; rows before a gap
        (a bounded replay) are dropped."""
        if (v is None) != (self.swa_v is None):
            raise ValueError("SWA V rows are written exactly when this layer holds them (pure-SWA layers of "
                             "swa_values models)")
        if len(self.swa) == 0 or pos0 != self.swa_pos0 + len(self.swa):
            self.swa = Store(self.swa.spec)
            self.swa_v = Store(self.swa.spec) if v is not None else None
            self.swa_pos0 = pos0
        self.swa.append(x)
        if v is not None:
            self.swa_v.append(v)

    def trim_swa(self) -> None:
        drop = max(0, len(self.swa) - self.window)
        for store in (self.swa, self.swa_v):
            if store is not None:
                store.keep_last(self.window)
        self.swa_pos0 += drop

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def nbytes(self) -> dict:
        pend = sum(t.numel() * t.element_size() for t in self.pending.values())
        swa = self.swa.nbytes + (self.swa_v.nbytes if self.swa_v is not None else 0)
        return {"swa": swa, "global": self.latents.nbytes, "index": self.index_keys.nbytes, "pending": pend}


class V41Cache(Cache):
    """The V4.1 model's cache: one `V41LayerCache` per layer."""

    def __init__(self, config):
        super().__init__(layers=[V41LayerCache(config, i) for i in range(config.num_hidden_layers)])

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[0].seen

    def nbytes(self) -> dict:
        """Held bytes by kind, summed over layers, and per layer."""
        per = [layer.nbytes() for layer in self.layers]
        tot = {k: sum(p[k] for p in per) for k in per[0]}
        return {**tot, "total": sum(tot.values()), "layers": per}
