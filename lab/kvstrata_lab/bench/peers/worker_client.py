"""Drives the kvpress worker from the benchmark: one request per model, rows streamed back."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

from tqdm import tqdm

from kvstrata.models.loader import resolve
from kvstrata_lab.bench.peers import venv


def run_kvpress(cfg, cells: list[tuple], methods: list[str], done: set[tuple], path: Path) -> None:
    """Run each missing (cell, press) row in the peers environment and append it to `path`."""

    work: dict[str, list[dict]] = {}
    for model_name, length, task, index in cells:
        missing = [m for m in methods if (model_name, length, task, index, m) not in done]
        if missing:
            work.setdefault(model_name, []).append(
                {"length": length, "task": task, "index": index, "methods": missing})
    if not work:
        return
    py = venv.ensure(log=lambda msg: tqdm.write(msg))
    bar = tqdm(total=sum(len(c["methods"]) for cs in work.values()
               for c in cs), desc="kvpress rows", unit="row")
    for model_name, todo in work.items():
        request = {"model": model_name, "model_path": str(resolve(model_name)), "cells": todo,
                   "seed": cfg.seed, "haystack": cfg.haystack, "dtype": cfg.dtype}
        with tempfile.NamedTemporaryFile(
            "w", suffix=".json", dir=cfg.out, prefix=".kvpress-", delete=False
        ) as tmp:
            json.dump(request, tmp)
        try:
            _stream(py, Path(tmp.name), path, bar)
        finally:
            os.unlink(tmp.name)
    bar.close()


def _stream(py: Path, request: Path, path: Path, bar) -> None:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    cmd = [str(py), "-m", "kvstrata_lab.bench.peers.kvpress_worker", str(request)]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env) as proc, path.open("a") as f:
        try:
            _copy_rows(proc, f, bar)
        except BaseException:  # interrupted: stop the worker too; finished rows are kept
            proc.kill()
            raise
    if proc.returncode != 0:
        raise RuntimeError(
            f"the kvpress worker exited with code {proc.returncode} (its messages are above); finished rows "
            "are kept and a rerun resumes"
        )


def _copy_rows(proc, f, bar) -> None:
    for line in proc.stdout:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            tqdm.write(f"kvpress worker printed a non-row line: {line.strip()[:200]}")
            continue
        f.write(json.dumps(row) + "\n")
        f.flush()
        bar.set_postfix_str(f"{row['model']} {row['length']} {row['task']}#{row['index']} {row['method']}")
        bar.update(1)
