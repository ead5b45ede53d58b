"""``kda-engram demo`` on the CPU (small configuration, kernels under the Triton
interpreter): it passes on the real system, and a wrong result anywhere in the
serving path -- a layer's arithmetic or a restored checkpoint -- makes it fail
with a non-zero exit status."""

import dataclasses

import pytest
import torch

from kda_engram.tools import demo
from kda_engram.tools.cli import main
from kda_engram.layers.kda import KimiDeltaAttention

# Enough to run every stage (a prompt resumed from its checkpoint at 64, one decode
# step) in a few seconds; the full small configuration runs once, through the CLI.
TINY = dataclasses.replace(demo.SMALL, kda_heads=1, prompt_lengths=(5, 66), decode_steps=1, gate_check_tokens=4)


def test_cli_demo_passes_on_cpu(capsys):
    assert main(["demo", "--device", "cpu", "--seed", "0"]) == 0
    out = capsys.readouterr().out
    for stage in ("build the block", "kernels on their own", "prefill 5 prompts of 1, 63, 64, 65, 150 tokens",
                  "resume prompt 4 from its checkpoint at 128", "decode 3 tokens for 6 sequences", "reference:"):
        assert stage in out, stage
    for check in ("resumed KDA output vs uninterrupted", "resumed conv window vs uninterrupted",
                  "copy's decode KDA output vs original's", "Engram output vs reference",
                  "KDA output vs reference", "KDA final states vs reference", "hash histories == reference"):
        assert f"ok   {check}" in out, check
    assert "FAIL" not in out
    assert "demo passed: all 18 checks within their bounds" in out


def test_demo_fails_on_wrong_results_and_names_them(monkeypatch, capsys):
    """Two independent faults in one (tiny) run: a 1% error in the KDA layer's
    output gate, caught only by the references (the resumed prompt is wrong the
    same way as its original), and a checkpoint restored without its conv window,
    caught only by the resume checks. Everything else must still pass."""
    output_gate = KimiDeltaAttention._output_gate
    monkeypatch.setattr(KimiDeltaAttention, "_output_gate", lambda self, o, g: output_gate(self, o, g) * 1.01)
    copy_row = demo._Caches.copy_row

    def copy_row_losing_the_conv_window(self, dst, src):
        copy_row(self, dst, src)
        self.conv[dst].zero_()

    monkeypatch.setattr(demo._Caches, "copy_row", copy_row_losing_the_conv_window)
    assert demo.run_demo(device="cpu", config=TINY) == 1
    out = capsys.readouterr().out
    for check in ("KDA output vs reference (on the same input)", "block output vs Engram + KDA references",
                  "resumed KDA output vs uninterrupted", "resumed KDA state vs uninterrupted"):
        assert f"FAIL {check}" in out, check
    for check in ("fused gate vs reference", "hash rows == reference", "Engram output vs reference",
                  "resumed hash history == uninterrupted", "hash histories == reference"):
        assert f"ok   {check}" in out, check
    assert "demo FAILED" in out and "demo passed" not in out


def test_bounds_relative_to_the_reference_magnitude():
    want = torch.tensor([0.5, -4.0])
    assert demo.Bound(1e-3).limit(want) == 1e-3
    assert demo.Bound(0.05, relative=True).limit(want) == pytest.approx(0.2)
