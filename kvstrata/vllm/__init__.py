"""kvstrata inside vLLM: `KvstrataConnector`, a KV connector that keeps vLLM's prefix KV in kvstrata's
store (`kv_connector_module_path: "kvstrata.vllm"`). The connector itself needs vLLM (its own
environment: `make vllm-env`); the chunk records, page maps and planning it is built from do not.
"""

from __future__ import annotations


def __getattr__(name: str):
    if name == "KvstrataConnector":  # imported on demand: vLLM is only in vLLM's environment
        from kvstrata.vllm.connector import KvstrataConnector

        return KvstrataConnector
    raise AttributeError(f"module 'kvstrata.vllm' has no attribute {name!r}")
