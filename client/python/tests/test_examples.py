"""The examples run against the test server and print errors within bf16 tolerance."""
import os
import re
import subprocess
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def run(server, *args):
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, env=os.environ)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_numpy_call(server):
    out = run(server, os.path.join(EXAMPLES, "numpy_call.py"), server.target)
    err = float(re.search(r"max \|O - O_f64\| = (\S+)", out).group(1))
    assert err < 2e-2, out


def test_llama_block(server):
    pytest.importorskip("torch")
    out = run(server, os.path.join(EXAMPLES, "llama_block.py"), server.target, "--prefill", "32", "--steps", "3")
    errs = [float(x) for x in re.findall(r"max \|attnd - torch\| = (\S+)", out)]
    assert len(errs) == 4, out
    # The decode steps' K and V are in the attnd sequence: its length follows the position.
    cached = re.findall(r"kv (\d+), cached in attnd: (\d+)", out)
    assert len(cached) == 3 and all(a == b for a, b in cached), out
    # bf16 activations of magnitude ~1-10 through one block: a few bf16 steps of difference.
    assert max(errs) < 0.25, out
