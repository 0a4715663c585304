"""examples/llama_engine.py on CPU against the test server: a tiny Llama-shaped model whose
attention runs in attnd KV sequences, in lock step with the same model on torch's attention over a
torch cache, then timed."""
import importlib.util
import json
import os

import pytest

pytest.importorskip("torch")

import attnd  # noqa: E402

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")

LAYERS, BATCH, PROMPT, STEPS, TIMING_STEPS = 2, 2, 8, 4, 2
TOLERANCE = 0.05
SHAPE = ["--layers", str(LAYERS), "--batch", str(BATCH), "--heads", "4", "--kv_heads", "2",
         "--head_dim", "64", "--hidden", "64", "--intermediate", "128", "--vocab", "100",
         "--prompt", str(PROMPT), "--steps", str(STEPS), "--warmup", "1",
         "--timing_steps", str(TIMING_STEPS)]


def load_example():
    spec = importlib.util.spec_from_file_location(
        "llama_engine", os.path.join(EXAMPLES, "llama_engine.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sequence_stats(server):
    with attnd.Client(server.target) as c:
        s = c.stats().get("sequences", {})  # proto3 JSON leaves zero fields out
    return s.get("open", 0), s.get("steps", 0)


def test_engine_matches_sdpa_in_lock_step(server, tmp_path):
    engine = load_example()
    report_path = tmp_path / "engine.json"
    open_before, steps_before = sequence_stats(server)
    argv = ["--backend", "both", "--device", "cpu", "--target", server.target,
            "--tolerance", str(TOLERANCE), "--json", str(report_path)] + SHAPE
    rc = engine.main(argv)
    assert rc == 0
    report = json.loads(report_path.read_text())
    # Every step compared (the prefill's last position, then each decode step), all within bf16
    # noise, and greedy decoding picks the same token everywhere.
    assert [r["step"] for r in report["compare"]] == ["prefill"] + list(range(STEPS))
    assert report["max_rel_err"] < TOLERANCE, report["compare"]
    assert report["top1_agreement"] == 1.0, report["compare"]
    for name in ("sdpa", "attnd"):
        r = report[name]
        assert r["timed_steps"] == STEPS - 1 and r["tokens_per_s"] > 0, r
        assert r["attention_calls"] == TIMING_STEPS * LAYERS and r["attention_host_us"] > 0, r
        assert r["attention_device_us"] is None, r  # CPU: no CUDA events
    assert report["ratio_tokens_per_s"] > 0
    # The attention ran in the server (a Step per layer: a prefill and the decode steps of the
    # lock-step run and of the timed run, then the timing pass), and the sequences were closed.
    open_after, steps_after = sequence_stats(server)
    assert open_after == open_before
    assert steps_after - steps_before >= LAYERS * (2 + STEPS + STEPS + TIMING_STEPS)


def test_engine_sdpa_alone_needs_no_server(tmp_path):
    # The baseline on its own: the model and torch's attention, no attnd client opened.
    engine = load_example()
    report_path = tmp_path / "sdpa.json"
    argv = ["--backend", "sdpa", "--device", "cpu", "--json", str(report_path)] + SHAPE
    assert engine.main(argv) == 0
    report = json.loads(report_path.read_text())
    assert report["attnd"] is None and report["max_rel_err"] is None
    assert report["sdpa"]["tokens_per_s"] > 0 and report["sdpa"]["timed_steps"] == STEPS - 1
