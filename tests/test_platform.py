import torch

from kda_engram import platform


def test_cpu_facts():
    assert platform.arch("cpu") == "cpu"
    assert platform.num_compute_units("cpu") == platform.CPU_COMPUTE_UNITS > 0


def test_interpreting_reads_env(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert platform.interpreting()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not platform.interpreting()
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not platform.interpreting()


def test_gpu_facts_when_present():
    if not torch.cuda.is_available():
        return
    name = platform.arch(0)
    assert name.startswith("sm_") or name.startswith("gfx")
