"""tools/precision_matrix.py's low-bit rows and columns (nf4, GGUF Q8_0 / Q4_0, merged into a GGUF)
and its concept_rate, end to end on the tiny random FLUX of test_precision_matrix: two 2-step rows,
one image, one sigma, one trigger prompt."""

import csv
import json
import math

import pytest

from test_precision_matrix import write_config
from tools import precision_matrix

ROWS = ("nf4", "gguf_q4_0")
COLUMNS = ("bf16+lora", "nf4+lora", "gguf_q8_0+lora", "gguf_q4_0+lora", "gguf_q4_0+merge")


def read_cells(out) -> dict:
    with open(out / "matrix.csv") as f:
        return {(r["trained_on"], r["deployed_on"]): {k: float(v) for k, v in r.items() if k not in ("trained_on", "deployed_on")}
                for r in csv.DictReader(f)}


def run(config, out, *extra) -> dict:
    assert precision_matrix.main(["--config_file", config, "--out", str(out), "--steps", "2", "--resolution", "64",
                                  "--max_items", "1", "--sigmas", "0.5", "--dtype", "fp32", *extra], log=print) == 0
    return read_cells(out)


def test_lowbit_rows_and_columns_with_a_concept_rate(tiny_set, tmp_path):
    config = write_config(tmp_path, tiny_set, "flux")
    concept = tmp_path / "concept.json"
    concept.write_text(json.dumps({"trigger": "zxq", "colour": "purple", "shape": "star", "unrelated_prompts": [],
                                   "trigger_prompts": ["a small zxq on the left, white background"]}))
    out = tmp_path / "matrix"
    cell = run(config, out, "--rows", ",".join(ROWS), "--columns", ",".join(COLUMNS), "--concept", str(concept))
    assert set(cell) == {(t, d) for t in ROWS for d in COLUMNS}
    # the GGUF row trained over the GGUF copy of the base, which the run wrote with our writer
    assert sorted(p.name for p in (out / "bases").iterdir()) == [
        "flux-gguf_q4_0+lora1.gguf", "flux-gguf_q4_0+lora2.gguf", "flux-gguf_q4_0.gguf", "flux-gguf_q8_0.gguf"]
    for trained in ROWS:
        assert cell[(trained, "bf16+lora")]["effect_kept"] == pytest.approx(1.0)
        for deploy in COLUMNS:
            c = cell[(trained, deploy)]
            assert c["concept_rate"] in (0.0, 1.0), c  # one trigger prompt: it renders the concept or not
            assert 0.0 < c["val_loss"] < 10.0 and 0.5 < c["effect_kept"] < 1.5, (trained, deploy, c)
        # Q8_0 keeps the LoRA's effect closer than Q4_0 does (the base rounds 16x finer)
        assert cell[(trained, "gguf_q8_0+lora")]["effect_error"] < cell[(trained, "gguf_q4_0+lora")]["effect_error"]
    text = (out / "matrix.md").read_text()
    assert "## concept_rate" in text and "| gguf_q4_0 |" in text and "Without the LoRA: " in text


def test_no_concept_rate_without_a_concept(tiny_set, tmp_path):
    """The tiny set's dataset has no concept.json beside it: the column is there, NaN, and no table."""
    config = write_config(tmp_path, tiny_set, "flux")
    out = tmp_path / "matrix"
    cell = run(config, out, "--rows", "bf16", "--columns", "bf16+lora,gguf_q8_0+lora")
    assert set(cell) == {("bf16", "bf16+lora"), ("bf16", "gguf_q8_0+lora")}
    assert all(math.isnan(c["concept_rate"]) for c in cell.values())
    assert "concept_rate" not in (out / "matrix.md").read_text()


def test_unknown_column_is_one_line_exit_2(tiny_set, tmp_path, capsys):
    config = write_config(tmp_path, tiny_set, "flux")
    assert precision_matrix.main(["--config_file", config, "--out", str(tmp_path / "m"), "--columns", "gguf_q4_k+lora"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "column 'gguf_q4_k+lora': expected one of" in err[0]
