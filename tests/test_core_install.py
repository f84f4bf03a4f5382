"""tools/check_core_only.py, which .ci/wheel runs in the fresh venv of the wheel before ``mmidx demo`` (so the demo
is proven to run on the core install alone), can fail: in the development environment it names the extras' packages."""

import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "check_core_only.py"


def test_the_development_environment_is_not_a_core_install_and_the_check_says_which_packages():
    result = subprocess.run([sys.executable, str(TOOL)], capture_output=True, text=True)
    assert result.returncode == 1
    named = {line.split()[0] for line in result.stdout.splitlines()}
    assert {"pytest", "ray", "hypothesis"} <= named
    assert "transformers" not in named and "tokenizers" not in named  # core, or pulled in by the core
