"""Setting up a session: what a cold start pays for."""

from __future__ import annotations

import subprocess
import sys


def test_loading_the_embedded_model_does_not_import_dynamo():
    """`torch._dynamo` costs seconds to import; building modules on the meta device used to pull it in
    (nn.Embedding's normal_ and a float arange go through torch._refs there)."""
    code = (
        "import sys\n"
        "from pipeline.runtime.session import load_session\n"
        "load_session()\n"
        "load_session(weights=False)\n"
        "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo was imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
