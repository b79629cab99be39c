"""`make gpu-proof` runs its checks here on the CPU under Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 without a GPU): the same script a GPU session runs, and it catches a wrong kernel."""

import json

import torch

from kvstrata.read.kernels import triton_decode
from kvstrata_lab.bench import gpu_proof

FEW = ("nvfp4", "int4:r=0", "fp8:v=mxfp4")
SMALL = {"gqa": (1, 4, 2, 64), "ragged": (2, 4, 2, 48)}


def test_every_check_passes_on_the_interpreter():
    rows = gpu_proof.check("cpu", FEW, SMALL, tokens=96)
    assert len(rows) == len(FEW) * (4 + 3)  # varlen: batch-1 shapes only
    assert all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]


def test_a_wrong_kernel_fails_its_check(monkeypatch):
    real = triton_decode.attend
    monkeypatch.setattr(triton_decode, "attend", lambda *a, **k: real(*a, **k) * 1.01)
    rows = gpu_proof.check("cpu", ("nvfp4",), {"gqa": (1, 4, 2, 64)}, tokens=96)
    assert [r["mode"] for r in rows if not r["ok"]] == ["dense", "softcap", "sparse", "varlen"]


def test_the_script_writes_its_report_and_exits_by_its_checks(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    real = gpu_proof.check
    monkeypatch.setattr(gpu_proof, "check", lambda device: real(device, ("mxfp4",), {"gqa": (1, 4, 2, 64)},
                                                                  96))
    assert gpu_proof.main(["--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_proof.json").read_text())
    assert report["device"].startswith("cpu") and len(report["checks"]) == 4 and report["timings"] == []
