"""The closed sets the store and the server name: tier classes, retention classes, how a prompt was
served and why a generation ended. Strings at the edges (record headers, HTTP, metrics, JSON) are
these values; inside, an unknown value is an error (`Name("bogus")` raises ValueError), never a
silent default."""

from __future__ import annotations

from enum import Enum


class Name(str, Enum):
    """A member that is its own string value: it compares, hashes, formats and serialises as it."""

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


class TierClass(Name):
    """Which KV a record holds: full-attention layers' (persistent) or sliding-window layers' (TTL pool)."""

    GLOBAL = "global"
    SWA = "swa"


class Retention(Name):
    """How long a request's global KV is kept (OpenAI's `prompt_cache_retention`): the persistent tier
    (disk / Redis, at least the store's retention) or this process's memory."""

    PERSISTENT = "24h"
    IN_MEMORY = "in_memory"


class ServeKind(Name):
    """How a prompt's KV was obtained: store hit, bounded replay of the sliding window, or full prefill."""

    HIT = "hit"
    REPLAY = "replay"
    MISS = "miss"


class FinishReason(Name):
    """Why a generation ended (`cancelled`: the client left; never sent to it)."""

    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
