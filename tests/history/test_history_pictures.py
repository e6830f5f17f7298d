"""``report --summary --plot FILE.svg|.html|.png`` and ``--heatmap``: the tensors x checkpoints
grid, parsed back and its cells' colours checked (a spike, a NaN, the baseline)."""

from __future__ import annotations

import base64
import io
import json
import re
import struct
import sys
import xml.etree.ElementTree as ET
import zlib

import numpy as np
import pytest
from rich.console import Console

from support.cli import run
from support.history import NAN, SPIKE, STEPS, files, names
from tclip.cli.render.cells import HIGH, MIDDLE, MISSING, NONFINITE, rgb, shades
from tclip.cli.render.heatmap import bins, render_heatmap
from tclip.cli.render.plot import Layout, html_picture, svg_picture
from tclip.work.history import Grid

SVG = "{http://www.w3.org/2000/svg}"
def decode_png(data: bytes) -> np.ndarray:
    """An 8-bit RGB PNG with filter 0 rows (as tclip writes them), decoded without Pillow."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width, height = 8, b"", 0, 0
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, colour = struct.unpack(">IIBB", body[:10])
            assert (depth, colour) == (8, 2)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw = np.frombuffer(zlib.decompress(idat), np.uint8).reshape(height, width * 3 + 1)
    assert (raw[:, 0] == 0).all()
    return raw[:, 1:].reshape(height, width, 3)


def cells_of_svg(text: str) -> tuple[ET.Element, np.ndarray, list[str]]:
    root = ET.fromstring(text)
    image = root.find(f".//{SVG}image")
    href = image.get("href")
    assert href.startswith("data:image/png;base64,")
    pixels = decode_png(base64.b64decode(href.split(",", 1)[1]))
    labels = [t.text for t in root.iter(f"{SVG}text") if t.text]
    return root, pixels, labels


def no_external_references(text: str) -> None:
    root = ET.fromstring(text)
    for element in root.iter():
        for key, value in element.attrib.items():
            if key.endswith("href"):
                assert value.startswith("data:"), (key, value)
    without_namespace = text.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert not re.search(r"(https?:)?//", without_namespace)


def test_svg_is_self_contained_and_colours_the_spike_and_the_nan(run_folder, tmp_path):
    out = tmp_path / "run.svg"
    result = run("report", "--summary", "--plot", out, *files(run_folder))
    assert result.exit_code == 0, result.output + result.stderr
    text = out.read_text()
    no_external_references(text)
    root, pixels, labels = cells_of_svg(text)
    rows = sorted(names(), key=lambda n: [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", n)])
    assert pixels.shape == (len(rows), STEPS, 3)
    spike = tuple(pixels[rows.index(SPIKE[0]), SPIKE[1]])
    nan = tuple(pixels[rows.index(NAN[0]), NAN[1]])
    assert spike == HIGH and nan == NONFINITE
    others = [tuple(pixels[r, c]) for r in range(len(rows)) for c in range(STEPS)
              if (rows[r], c) not in ((SPIKE[0], SPIKE[1]), (NAN[0], NAN[1]))]
    assert all(max(abs(int(a) - b) for a, b in zip(p, MIDDLE)) < 40 for p in others)  # the baseline: pale
    assert NONFINITE not in others and HIGH not in others
    assert "step_400" in labels and "model.layers.10.mlp.down_proj.weight" in labels
    assert any("layer 10" == t for t in labels) and any("NaN/Inf" == t for t in labels)
    assert root.find(f"{SVG}title").text.startswith("tclip report --summary --plot")


def test_html_is_offline_and_carries_every_value_for_hovering(run_folder, tmp_path):
    out = tmp_path / "run.html"
    result = run("report", "--summary", "--plot", out, *files(run_folder))
    assert result.exit_code == 0, result.stderr
    text = out.read_text()
    assert not re.search(r"<script[^>]*\bsrc\s*=", text, re.I) and not re.search(r"<link\b", text, re.I)
    assert not re.search(r"(https?:)?//(?!www\.w3\.org/2000/svg)", text)  # no URL but the SVG namespace
    svg = text[text.index("<svg"):text.index("</svg>") + 6]
    no_external_references(svg)
    data = json.loads(re.search(r'<script type="application/json" id="grid-data">(.*?)</script>', text, re.S)[1])
    r, c = data["rows"].index(SPIKE[0]), SPIKE[1]
    assert data["columns"][c] == f"step_{c * 100}"
    reports = [json.loads(line) for line in run("report", "--json", files(run_folder)[c]).output.splitlines()]
    norm = next(t["norm"] for t in reports[0]["tensors"] if t["name"] == SPIKE[0])
    assert data["values"][r][c] == pytest.approx(norm, rel=1e-5)
    assert data["values"][data["rows"].index(NAN[0])][NAN[1]] == "NaN"
    assert "mousemove" in text


def test_png_shows_the_cells_in_their_colours(run_folder, tmp_path):
    pil = pytest.importorskip("PIL.Image")
    out = tmp_path / "run.png"
    result = run("report", "--summary", "--plot", out, *files(run_folder))
    assert result.exit_code == 0, result.stderr
    picture = np.asarray(pil.open(out).convert("RGB"))
    rows = sorted(names(), key=lambda n: [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", n)])
    box = Layout(len(rows), STEPS, rows, [f"step_{i * 100}" for i in range(STEPS)])
    assert picture.shape[0] == box.height and picture.shape[1] >= box.width

    def centre(name: str, step: int) -> tuple[int, ...]:
        y = box.top + rows.index(name) * box.cell_h + box.cell_h // 2
        x = box.left + step * box.cell_w + box.cell_w // 2
        return tuple(int(v) for v in picture[y, x])

    assert centre(*SPIKE) == HIGH and centre(*NAN) == NONFINITE


def test_png_without_pillow_is_one_clear_error(run_folder, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "PIL", None)
    out = tmp_path / "run.png"
    result = run("report", "--summary", "--plot", out, *files(run_folder))
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines()[-1] == \
        f"Error: {out}: writing .png needs Pillow (pip install 'tclip[png]'); .svg and .html need nothing"
    assert not out.exists() and not list(tmp_path.glob(".run.png*"))


def test_colours_are_relative_to_each_rows_median():
    values = np.array([[1.0, 1.0, 10.0, 0.1], [1e6, 1e6, 1e7, 1e5], [1.0, np.nan, np.inf, 1.0]])
    present = np.ones_like(values, dtype=bool)
    present[0, 3] = False
    colours = rgb(shades(values, present))
    assert (colours[0, 2] == colours[1, 2]).all()  # x10 is x10, whatever the row's scale
    assert tuple(colours[0, 3]) == MISSING and tuple(colours[2, 1]) == NONFINITE == tuple(colours[2, 2])
    finite = [tuple(c) for c in colours[:2].reshape(-1, 3)]
    assert NONFINITE not in finite and MISSING not in [tuple(c) for c in colours[1]]


@pytest.mark.slow  # a 200 x 1000 grid drawn
def test_200_tensors_by_1000_steps_is_one_picture_under_5_mb():
    rng = np.random.default_rng(1)
    rows = [f"model.layers.{i // 8}.block.{i % 8}.weight" for i in range(200)]
    values = (1 + 0.05 * rng.standard_normal((200, 1000))).tolist()
    values[17][500] = 1e4
    values[30][999] = float("nan")
    grid = Grid("norms", [f"run/step_{i}.safetensors" for i in range(1000)], rows, values)
    labels = [f"step_{i}" for i in range(1000)]
    svg = svg_picture(grid, labels, "tclip report --summary --plot x.svg")
    html = html_picture(grid, labels, "tclip report --summary --plot x.html")
    assert len(svg.encode()) < 5e6 and len(html.encode()) < 5e6
    _, pixels, _ = cells_of_svg(svg)
    assert pixels.shape == (200, 1000, 3) and tuple(pixels[17, 500]) == HIGH


def test_heatmap_names_its_rows_and_writes_no_escape_to_a_pipe_or_with_no_color(run_folder):
    for env in ({"NO_COLOR": "1"}, {}):
        result = run("report", "--summary", "--heatmap", *files(run_folder), env=env)
        assert result.exit_code == 0, result.stderr
        assert "\x1b" not in result.output
        heat = result.output[result.output.index("tensors x 6 checkpoints"):].splitlines()
        nan_row = next(line for line in heat if line.startswith("model.layers.2.self_attn.k_proj.weight"))
        assert nan_row.split()[-1][NAN[1]] == "!"
        spike_row = next(line for line in heat if line.startswith(SPIKE[0]))
        assert spike_row.split()[-1][SPIKE[1]] == "█"
    coloured = run("report", "--summary", "--heatmap", "--color", "always", *files(run_folder))
    assert "\x1b[" in coloured.output


def test_heatmap_bins_steps_to_the_width_keeping_the_spike():
    rows = ["a.weight", "b.weight"]
    values = [[1.0] * 500, [1.0] * 500]
    values[1][333] = 1e3
    grid = Grid("norms", [f"s{i}" for i in range(500)], rows, values)
    buffer = io.StringIO()
    render_heatmap(grid, [f"s{i}" for i in range(500)], Console(file=buffer, width=80, color_system=None), 80)
    lines = buffer.getvalue().splitlines()
    body = [line for line in lines if line.startswith(("a.weight", "b.weight"))]
    assert all(len(line) <= 80 for line in body)
    assert body[1].count("█") == 1 and "█" not in body[0]
    assert [len(b) for b in bins(500, 66)] == [len(b) for b in bins(500, 66)] and sum(map(len, bins(500, 66))) == 500


@pytest.mark.slow  # two child interpreters import tclip
def test_pictures_cost_nothing_until_asked_for(run_folder):
    """--help imports none of it; a summary without --plot/--heatmap imports no picture module nor Pillow."""
    import subprocess

    heavy = ["tclip.work.history", "tclip.work.adam", "tclip.cli.history", "tclip.cli.render.plot",
             "tclip.cli.render.heatmap", "tclip.cli.render.cells", "PIL", "numpy"]
    code = ("import sys\nfrom tclip.cli import cli\n"
            "try:\n    cli(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            f"print(*[m in sys.modules for m in {heavy!r}], file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", code, "report", "--help"], capture_output=True, text=True)
    assert done.stderr.split() == ["False"] * len(heavy), done.stderr
    summary = [sys.executable, "-c", code, "report", "--summary", "-q", *map(str, files(run_folder))]
    done = subprocess.run(summary, capture_output=True, text=True)
    assert done.stderr.split()[:-1] == ["False"] * (len(heavy) - 1), done.stderr  # numpy: it measures


def test_summary_json_carries_every_tensors_norm(run_folder):
    result = run("report", "--summary", "--json", *files(run_folder))
    items = [json.loads(line) for line in result.output.splitlines()]
    assert [len(i["norms"]) for i in items] == [len(names())] * STEPS
    spike = next(n for n in items[SPIKE[1]]["norms"] if n["name"] == SPIKE[0])
    single = json.loads(run("report", "--json", files(run_folder)[SPIKE[1]]).output.splitlines()[0])
    assert spike["norm"] == next(t["norm"] for t in single["tensors"] if t["name"] == SPIKE[0])
    assert next(n for n in items[NAN[1]]["norms"] if n["name"] == NAN[0])["norm"] == "nan"  # as --json spells NaN
