"""The pictures of ``report --summary --plot`` as a real browser draws them: headless Chromium
(Debian's ``chromium``) screenshots the SVG and the HTML, and the spike's cell and a NaN cell
show in their colours. Skipped, with the reason, where Chromium or Pillow is absent."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from tclip.cli import cli
from tclip.cli.render.cells import HIGH, NONFINITE
from tclip.cli.render.plot import Layout, picture_data
from tclip.work.history import norms_grid
from test_history_pictures import NAN, SPIKE, files, run_folder  # noqa: F401 (a fixture)

CHROMIUM = Path("/usr/bin/chromium")
pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason="headless Chromium (/usr/bin/chromium) is not installed")
HTML_MARGIN = 12  # the page's body margin


def screenshot(page: Path, out: Path, profile: Path, width: int, height: int) -> np.ndarray:
    image = pytest.importorskip("PIL.Image")
    done = subprocess.run(
        [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={profile}", "--hide-scrollbars", "--force-device-scale-factor=1",
         f"--window-size={width},{height}", f"--screenshot={out}", page.as_uri()],
        capture_output=True, text=True, timeout=120)
    assert out.exists(), done.stderr[-2000:]
    return np.asarray(image.open(out).convert("RGB"))


@pytest.mark.parametrize("suffix", [".svg", ".html"])
def test_chromium_shows_the_spike_and_the_nan_in_their_colours(run_folder, tmp_path, suffix):  # noqa: F811
    picture = tmp_path / f"run{suffix}"
    inputs = files(run_folder)
    result = CliRunner().invoke(cli, ["report", "--summary", "--plot", str(picture), *map(str, inputs)])
    assert result.exit_code == 0, result.stderr
    # where the cells are: the same layout the picture was drawn with
    from tclip.work.clip import report_file
    from tclip.work.summary import file_labels

    grid = norms_grid([report_file(p) for p in inputs])
    labels = file_labels(grid.columns)
    order, _, _, names, columns = picture_data(grid, [labels[c] for c in grid.columns])
    box = Layout(len(order), len(grid.columns), names, columns)
    shot = screenshot(picture, tmp_path / "shot.png", tmp_path / "profile", 1000, box.height + 2 * HTML_MARGIN + 40)
    offset = HTML_MARGIN if suffix == ".html" else 0
    rows = [grid.rows[i] for i in order]

    def centre(name: str, step: int) -> tuple[int, ...]:
        y = offset + box.top + int((rows.index(name) + 0.5) * box.cell_h)
        x = offset + box.left + int((step + 0.5) * box.cell_w)
        return tuple(int(v) for v in shot[y, x])

    assert centre(*SPIKE) == HIGH
    assert centre(*NAN) == NONFINITE
