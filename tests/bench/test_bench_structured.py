"""`ds4f bench structured`: a vocabulary's record (the checkpoint's tokenizer given as MODEL), and
the CLI's table of it."""
from __future__ import annotations

import json

import pytest

from ds4f.bench import structured
from ds4f.cli import main


@pytest.fixture()
def quick(monkeypatch):
    monkeypatch.setattr(structured, "ANSWERS", 2)
    monkeypatch.setattr(structured, "MEMORY_REQUESTS", 16)


def test_a_tokenizers_record(tiny_model, quick):
    from ds4f.engine.text.tokenizer import Tokenizer

    r = structured.bench_tokenizer("tiny", Tokenizer.load(tiny_model))
    assert r["ids"] == 512 and r["tokens"] >= 2 * 5          # two answers of five fields at least
    for key in ("mask_us_median", "mask_us_p90", "mask_us_max", "greedy_pick_us", "sampled_pick_us", "compile_ms"):
        assert r[key] > 0, key
    assert r["mask_us_median"] <= r["mask_us_p90"] <= r["mask_us_max"]
    assert 0 <= r["wide_steps"] <= 1 and r["request_kib"] >= 0


def test_the_cli_prints_every_vocabulary(tiny_model, quick, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(structured, "GEOMETRIES", {"demo": structured.GEOMETRIES["tiny"],
                                                   "flash": structured.GEOMETRIES["tiny"]})
    out = tmp_path / "r.json"
    assert main(["bench", "structured", str(tiny_model), "--json", str(out)]) == 0
    records = json.loads(out.read_text())
    assert [r["vocab"] for r in records] == ["demo (synthetic)", "flash (synthetic)", tiny_model.name]
    assert "mask µs" in capsys.readouterr().out
