"""The peers' own virtual environment: kvpress pins transformers < 5.3, which ours is not.

Created on first use (`kvstrata bench --peers kvpress:…`) under
`$KVSTRATA_PEERS_VENV` (default `~/.cache/kvstrata/peers-venv`): the same torch as ours, kvpress
and its transformers, and this checkout's kvstrata and kvstrata-lab sources installed editable
without dependencies so the worker runs exactly the benchmark code of the caller.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

import kvstrata_lab
from kvstrata.models.loader import cache_dir
from kvstrata_lab.bench.peers import KVPRESS_TRANSFORMERS, KVPRESS_VERSION

STAMP = ".kvstrata-peers.json"


def venv_dir() -> Path:
    return Path(os.environ.get("KVSTRATA_PEERS_VENV", cache_dir() / "peers-venv"))


def python() -> Path:
    return venv_dir() / "bin" / "python"


def source_root() -> Path:
    """The checkout: the library at its root, the lab in `lab/`."""
    root = Path(kvstrata_lab.__file__).resolve().parents[2]
    if not (root / "pyproject.toml").exists() or not (root / "lab" / "pyproject.toml").exists():
        raise RuntimeError(f"kvstrata-lab is not installed from a checkout ({root}); the peers environment "
                           "installs that source: `pip install -e <checkout> -e <checkout>/lab`")
    return root


def wanted() -> dict:

    return {"torch": torch.__version__.split("+")[0], "transformers": KVPRESS_TRANSFORMERS,
            "kvpress": KVPRESS_VERSION, "source": str(source_root())}


def ready() -> bool:
    stamp = venv_dir() / STAMP
    try:
        return json.loads(stamp.read_text()) == wanted() and python().exists()
    except (OSError, json.JSONDecodeError):
        return False


def ensure(log=print) -> Path:
    """The peers environment's python, creating or updating the environment if needed."""
    if ready():
        return python()
    want = wanted()
    d = venv_dir()
    log(f"creating the peers environment in {d} (kvpress {want['kvpress']}, transformers "
        f"{want['transformers']}, torch {want['torch']}); a few minutes, once")
    steps = [
        [sys.executable, "-m", "venv", str(d)],
        [str(python()), "-m", "pip", "install", "-q", f"torch=={want['torch']}"],
        [str(python()), "-m", "pip", "install", "-q",
             f"transformers=={want['transformers']}", f"kvpress=={want['kvpress']}"],
        [str(python()), "-m", "pip", "install", "-q", "--no-deps", "-e", want["source"], "-e",
         str(Path(want["source"]) / "lab")],
    ]
    for cmd in steps:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"peers environment: `{' '.join(cmd)}` failed:\n{proc.stderr[-2000:]}")
    (d / STAMP).write_text(json.dumps(want))
    return python()
