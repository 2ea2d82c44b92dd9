"""``keep_freed_memory``: glibc's thresholds raised, in a child process (it is process-wide)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fedddl.compression.backends.allocator import keep_freed_memory


def test_takes_effect_on_glibc_and_changes_no_result() -> None:
    code = (
        "import torch\n"
        "from fedddl.compression import TernaryCompressor, decode_update, encode_update\n"
        "from fedddl.compression.backends.allocator import keep_freed_memory\n"
        "x = {'w': torch.randn(3000, generator=torch.Generator().manual_seed(0))}\n"
        "before = encode_update(x, TernaryCompressor(seed=1))\n"
        "ok = keep_freed_memory()\n"
        "after = encode_update(x, TernaryCompressor(seed=1))\n"
        "assert before == after\n"
        "assert torch.equal(decode_update(after)['w'], decode_update(before)['w'])\n"
        "print(ok)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    result = done.stdout.strip()
    assert result in ("True", "False")
    if sys.platform.startswith("linux") and "glibc" in " ".join(__import__("platform").libc_ver()):
        assert result == "True"


def test_rejects_a_non_positive_threshold() -> None:
    with pytest.raises(ValueError, match="positive"):
        keep_freed_memory(0)
