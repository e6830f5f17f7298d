"""``convert -q`` starts without what only printing needs (a conversion's wall time against ``dd``
is mostly the process's start-up on a small checkpoint)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

CODE = ("import sys\nfrom tclip.cli import cli\n"
        "try:\n    cli(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
        "print(*sorted({m.split('.')[0] for m in sys.modules if m.split('.')[0] == 'rich'}), file=sys.stderr)\n")


def test_quiet_convert_imports_no_rich(tmp_path: Path) -> None:
    source = tmp_path / "model.safetensors"
    save_file({"model.layers.17.self_attn.k_proj.weight": np.arange(12, dtype=np.float32).reshape(3, 4)}, str(source))
    done = subprocess.run([sys.executable, "-c", CODE, "convert", "-q", str(source), str(tmp_path / "out")],
                          capture_output=True, text=True)
    assert (tmp_path / "out" / "model.safetensors").is_file(), done.stderr
    assert done.stderr.split() == [], done.stderr
    shown = subprocess.run([sys.executable, "-c", CODE, "convert", "--force", str(source), str(tmp_path / "out")],
                           capture_output=True, text=True)
    assert "1 tensor" in shown.stdout and shown.stderr.split() == ["rich"], (shown.stdout, shown.stderr)
