"""The pictures of ``report --summary --plot`` as a real browser draws them: headless Chromium
(Debian's ``chromium``) screenshots the SVG and the HTML, and the spike's cell and a NaN cell
show in their colours. Skipped, with the reason, where Chromium or Pillow is absent."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from support.history import NAN, SPIKE, files
from tclip.cli import cli
from tclip.cli.render.cells import HIGH, NONFINITE
from tclip.cli.render.plot import Layout, picture_data
from tclip.work.history import norms_grid

CHROMIUM = Path("/usr/bin/chromium")
pytestmark = [pytest.mark.skipif(not CHROMIUM.exists(), reason="headless Chromium (/usr/bin/chromium) is not installed"),
              pytest.mark.slow]  # a browser started per picture
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


def test_chromium_hovering_a_cell_shows_its_tensor_checkpoint_and_value(run_folder, tmp_path):  # noqa: F811
    """The page's own script answers a pointer over the spike's cell (a synthetic mousemove,
    appended to a copy of the page); Chromium's --dump-dom gives the tooltip's text."""
    picture = tmp_path / "run.html"
    inputs = files(run_folder)
    result = CliRunner().invoke(cli, ["report", "--summary", "--plot", str(picture), *map(str, inputs)])
    assert result.exit_code == 0, result.stderr
    from tclip.work.clip import report_file
    from tclip.work.summary import file_labels

    grid = norms_grid([report_file(p) for p in inputs])
    labels = file_labels(grid.columns)
    order, _, _, names, columns = picture_data(grid, [labels[c] for c in grid.columns])
    box = Layout(len(order), len(grid.columns), names, columns)
    rows = [grid.rows[i] for i in order]
    x = (SPIKE[1] + 0.5) * box.cell_w
    y = (rows.index(SPIKE[0]) + 0.5) * box.cell_h
    probe = tmp_path / "probe.html"
    probe.write_text(picture.read_text().replace(
        "</body>", "<script>var i = document.getElementById('cells'), b = i.getBoundingClientRect();"
                   f"i.dispatchEvent(new MouseEvent('mousemove', {{clientX: b.left + {x}, clientY: b.top + {y}, "
                   "bubbles: true}));</script></body>"))
    done = subprocess.run(
        [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1000,900", "--dump-dom", probe.as_uri()],
        capture_output=True, text=True, timeout=120)
    tip = re.search(r'<div id="tip"[^>]*>(.*?)</div>', done.stdout, re.S)
    assert tip, done.stdout[-2000:] + done.stderr[-2000:]
    value = grid.values[grid.rows.index(SPIKE[0])][SPIKE[1]]
    tensor, checkpoint, shown = tip[1].split("\n")
    assert (tensor, checkpoint) == (SPIKE[0], labels[grid.columns[SPIKE[1]]])
    assert shown.startswith("norms: ") and float(shown.split(": ")[1]) == pytest.approx(value, rel=1e-6)
