"""The README's Python example runs as pasted (the model path aside): on
vLLM's CPU build the engine core starts in a spawned process, which imports
the script again, so an example without its ``__main__`` guard fails there."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT
from vllm_kvmem.demo_engine import engine_env


def readme_python_example() -> str:
    """The README's Python block that calls ``vllm_kvmem.register()``."""
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    (example,) = [b for b in blocks if "vllm_kvmem.register()" in b]
    return example


@pytest.mark.engine
def test_the_readme_python_example_runs_as_pasted(model_8l, tmp_path):
    example = readme_python_example()
    assert 'if __name__ == "__main__":' in example
    script = tmp_path / "example.py"
    script.write_text(example.replace("path/to/model", str(model_8l)))
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=engine_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    lines = [x for x in done.stdout.splitlines() if "cached prompt tokens:" in x]
    cached = [int(x.rsplit(":", 1)[1]) for x in lines]
    # The second pass finds the prompt's full blocks cached.
    assert len(cached) == 2 and cached[0] == 0 and cached[1] > 0


def test_vllm_kvmem_llm_registers_first():
    """``vllm_kvmem.LLM`` takes the step a script forgets: its options reach
    vllm-kvmem's checks (here a bad value, refused before any engine starts)
    instead of vLLM's ``TypeError`` for an unknown keyword."""
    code = (
        "import vllm_kvmem\n"
        "try:\n"
        "    vllm_kvmem.LLM('unused', kv_cache_tokens='lots')\n"
        "except Exception as e:\n"
        "    print(type(e).__name__, e)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=engine_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "unexpected keyword argument" not in done.stdout
    assert "kv_cache_tokens" in done.stdout and "lots" in done.stdout
