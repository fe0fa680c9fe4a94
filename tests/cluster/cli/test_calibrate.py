"""``rdserve calibrate`` on the tiny model: measures, derives, and writes a loadable schedule."""

from __future__ import annotations

import json

import pytest

from typer.testing import CliRunner

from cluster.cli.main import app
from cluster.config import load_config
from workers.speculation.schedule import derive_schedule


def test_calibrate_writes_the_schedule_its_figures_imply(tiny_config_path, tmp_path):
    config = tiny_config_path.parent / "calibrate.yaml"
    config.write_text(tiny_config_path.read_text())
    out = tmp_path / "cal.json"
    result = CliRunner().invoke(app, [
        "calibrate", "-c", str(config), "--batch-sizes", "1,3", "--shapes", "1x2,2x2", "--repeats", "2",
        "--max-tokens", "8", "--prompts-per-category", "1", "--context-len", "16", "--out", str(out),
    ])
    assert result.exit_code == 0, result.output
    figures = json.loads(out.read_text())
    assert figures["draft_search"] == load_config(config).speculation.draft_search  # what the tokens per step were measured with
    from workers.code_version import code_version

    assert figures["code_version"] == code_version()  # replicas of this code trust its step times
    import torch

    # ...on the same KV cache dtype and thread count (the tiny config's cache is float32)
    assert figures["kv_cache_dtype"] == "float32" and figures["num_threads"] == torch.get_num_threads()
    assert set(figures["plain_step_s"]) == {"1", "3"}
    assert set(figures["spec_step_s"]) == {"1:1x2", "1:2x2", "3:1x2", "3:2x2"}
    assert all(v > 0 for v in figures["plain_step_s"].values())
    assert all(1.0 <= v <= 3.0 for v in figures["tokens_per_step"].values())
    shape = {k: tuple(int(x) for x in k.split("x")) for k in figures["tokens_per_step"]}
    table = derive_schedule(
        {int(b): s for b, s in figures["plain_step_s"].items()},
        {(int(k.split(":")[0]), shape[k.split(":")[1]]): s for k, s in figures["spec_step_s"].items()},
        {shape[k]: v for k, v in figures["tokens_per_step"].items()},
    )
    written = load_config(config)
    assert written.speculation.policy == ("off" if table == "off" else "table")
    assert written.speculation.table == (None if table == "off" else table)
    rows = [] if table == "off" else [r for r in table if r.num_beams]
    assert written.speculation.spec_max_load == max((r.max_batch_size for r in rows), default=0)
    assert "derived by `rdserve calibrate`" in config.read_text()
    again = CliRunner().invoke(app, [  # calibrating a calibrated config replaces the table and its note
        "calibrate", "-c", str(config), "--batch-sizes", "1", "--shapes", "1x2", "--repeats", "1",
        "--max-tokens", "4", "--prompts-per-category", "1", "--context-len", "8", "--out", str(out),
    ])
    assert again.exit_code == 0, again.output
    again_table = derive_schedule(
        {1: json.loads(out.read_text())["plain_step_s"]["1"]}, {(1, (1, 2)): json.loads(out.read_text())["spec_step_s"]["1:1x2"]},
        {(1, 2): json.loads(out.read_text())["tokens_per_step"]["1x2"]})
    assert load_config(config).speculation.table == (None if again_table == "off" else again_table)
    assert config.read_text().count("derived by `rdserve calibrate`") == 1
    assert figures["table"] == ("off" if table == "off" else [r.model_dump() for r in table])


def test_calibrate_rejects_a_bad_shape(tiny_config_path):
    result = CliRunner().invoke(app, ["calibrate", "-c", str(tiny_config_path), "--shapes", "2by2"])
    assert result.exit_code == 2
    assert "expected NUM_BEAMSxDRAFT_LEN" in result.output


def test_calibrate_fills_the_entry_of_the_compute_path_it_ran_on(tiny_config_path, tmp_path):
    """With speculation.by_compute_path in the config, the table goes under the path measured; the
    other paths' entries, speculation.table and speculation.spec_max_load stay as they were."""
    import yaml

    data = yaml.safe_load(tiny_config_path.read_text())
    other = [{"max_batch_size": 7, "num_beams": 2, "draft_len_per_beam": 2}]
    data["speculation"].update(by_compute_path={"gguf-avx512-int8": {"table": other}}, policy="table",
                               table=[{"max_batch_size": 3, "num_beams": 1, "draft_len_per_beam": 1}], spec_max_load=3)
    config = tiny_config_path.parent / "calibrate_by_kernel.yaml"
    config.write_text(yaml.safe_dump(data))
    out = tmp_path / "cal.json"
    result = CliRunner().invoke(app, [
        "calibrate", "-c", str(config), "--batch-sizes", "1,2", "--shapes", "1x2", "--repeats", "1",
        "--max-tokens", "4", "--prompts-per-category", "1", "--context-len", "8", "--out", str(out),
    ])
    assert result.exit_code == 0, result.output
    figures = json.loads(out.read_text())
    path = figures["compute_path"]
    assert path.startswith(("float32-", "gguf-")) and f"speculation.by_compute_path.{path}.table written" in result.output
    written = load_config(config).speculation
    assert written.by_compute_path[path].table == (
        "off" if figures["table"] == "off" else [type(written.table[0])(**r) for r in figures["table"]])
    assert [r.model_dump() for r in written.by_compute_path["gguf-avx512-int8"].table] == other
    assert [r.model_dump() for r in written.table] == [{"max_batch_size": 3, "num_beams": 1, "draft_len_per_beam": 1}]
    assert written.spec_max_load == 3


def test_writing_one_compute_paths_entry_keeps_the_others_and_their_comments(tmp_path):
    from cluster.cli.calibrate import _write_path_entry, _yaml_rows

    text = """speculation:
  by_compute_path:
    # laptops
    gguf-avx2:
      table:
      - {max_batch_size: 2, num_beams: 1, draft_len_per_beam: 2}
    # servers: keep
    gguf-avx512-int8:
      table:
      - {max_batch_size: 2, num_beams: 1, draft_len_per_beam: 2}
    float32-avx2: {table: "off"}
    # the router follows the schedule
  spec_max_load: 2
"""
    config = tmp_path / "c.yaml"
    rows = [{"max_batch_size": 4, "num_beams": 2, "draft_len_per_beam": 2}]
    for kernel, value in (("gguf-avx2", rows), ("float32-avx2", "off"), ("float32-torch", rows)):
        config.write_text(text)
        _write_path_entry(config, kernel, "table", _yaml_rows(value), "new note")
        written = config.read_text()
        for comment in ("# laptops", "# servers: keep", "# the router follows the schedule"):
            assert comment in written, (kernel, written)
        assert ("# new note" in written) == (kernel == "float32-torch"), written  # only a new entry gets the note
        table = {k: v.table for k, v in load_config(config).speculation.by_compute_path.items()}
        assert (table[kernel] if value == "off" else [r.model_dump() for r in table[kernel]]) == value
        assert [r.model_dump() for r in table["gguf-avx512-int8"]] == [
            {"max_batch_size": 2, "num_beams": 1, "draft_len_per_beam": 2}]
        assert load_config(config).speculation.spec_max_load == 2


def test_calibrate_adds_the_calibration_of_the_compute_path_it_ran_on(tiny_config_path):
    """Policy 'auto' with calibrations keyed by compute path: a path without an entry gets a
    new file next to the config and its entry; a second run rewrites that file and leaves the config."""
    import yaml

    first = tiny_config_path.parent / "first.calibration.json"
    data = yaml.safe_load(tiny_config_path.read_text())
    data["speculation"].update(policy="auto", by_compute_path={"gguf-avx512-int8": {"calibration": first.name}})
    config = tiny_config_path.parent / "calibrate_auto.yaml"
    config.write_text(yaml.safe_dump(data))
    args = ["calibrate", "-c", str(config), "--batch-sizes", "1", "--shapes", "1x2", "--repeats", "1",
            "--max-tokens", "4", "--prompts-per-category", "1", "--context-len", "8"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    written = load_config(config).speculation.by_compute_path
    kernel = next(k for k in written if k != "gguf-avx512-int8")
    out = tiny_config_path.parent / f"calibrate_auto.calibration.{kernel}.json"
    assert {k: v.calibration for k, v in written.items()} == {"gguf-avx512-int8": first, kernel: out}
    assert json.loads(out.read_text())["compute_path"] == kernel
    assert f"calibration: {out.name}" in config.read_text()  # relative to the config, as a user writes it
    elsewhere = CliRunner().invoke(app, [*args, "--out", str(config.parent / "missing-dir" / "x.json")])
    assert elsewhere.exit_code == 2 and "does not exist" in elsewhere.output  # before any measuring
    before = config.read_text()
    out.write_text("{}")
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 0, again.output
    assert config.read_text() == before and f"speculation.by_compute_path.{kernel}.calibration" in again.output
    assert json.loads(out.read_text())["compute_path"] == kernel


def test_calibrate_without_write_says_a_new_path_is_not_read(tiny_config_path):
    import yaml

    data = yaml.safe_load(tiny_config_path.read_text())
    data["speculation"].update(policy="auto", by_compute_path={"cuda": {"calibration": "cuda.json"}})
    config = tiny_config_path.parent / "calibrate_nowrite.yaml"
    config.write_text(yaml.safe_dump(data))
    result = CliRunner().invoke(app, ["calibrate", "-c", str(config), "--batch-sizes", "1", "--shapes", "1x2",
                                      "--repeats", "1", "--max-tokens", "4", "--prompts-per-category", "1",
                                      "--context-len", "8", "--no-write"])
    assert result.exit_code == 0, result.output
    assert "not read at start" in result.output and "no speculation.by_compute_path." in " ".join(result.output.split())
    assert load_config(config).speculation.by_compute_path["cuda"].calibration == config.parent / "cuda.json"


def test_a_calibration_measured_elsewhere_or_with_another_draft_search_is_reported(tmp_path, caplog):
    from workers.speculation.policy import warn_if_measured_elsewhere

    cal, old = tmp_path / "cal.json", tmp_path / "old.json"
    cal.write_text(json.dumps({"compute_path": "gguf-avx2-int8", "draft_search": "beam"}))
    old.write_text(json.dumps({"kernel": "gguf-avx2-int8"}))  # files written before the rename
    with caplog.at_level("WARNING", logger="workers.speculation.policy"):
        warn_if_measured_elsewhere(cal, "gguf-avx2-int8", "speculation.calibration", draft_search="beam")
        assert not caplog.records
        warn_if_measured_elsewhere(cal, "gguf-avx512-int8", "speculation.calibration", draft_search="distinct_first")
        warn_if_measured_elsewhere(old, "gguf-avx512-int8", "speculation.calibration")
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "measured on compute path gguf-avx2-int8" in text and "speculation.draft_search beam" in text
    assert len(caplog.records) == 3


def test_each_step_cost_is_the_median_of_its_rounds(tiny_config_path, tmp_path, monkeypatch):
    """``--rounds 3``: the step-cost sweep runs three times and each figure is the median of its three
    measurements, so one round taken in a slow spell (here the second, 4x slower) decides nothing;
    the file records the rounds and each figure's spread between them."""
    from workers.speculation import calibration

    config = tiny_config_path.parent / "calibrate_rounds.yaml"
    config.write_text(tiny_config_path.read_text())
    out = tmp_path / "cal.json"
    calls = []

    def fake_measure(engine, b, shape, **kw):  # round r of (b, shape): base * [1.0, 4.0, 1.1][r]
        calls.append((b, shape))
        r = calls.count((b, shape)) - 1
        base = 0.004 * b * (1 if shape is None else shape[0] * shape[1] + 1)
        return base * (1.0, 4.0, 1.1)[r]

    monkeypatch.setattr(calibration, "measure_step_s", fake_measure)
    result = CliRunner().invoke(app, [
        "calibrate", "-c", str(config), "--batch-sizes", "1,3", "--shapes", "1x2", "--repeats", "1", "--rounds", "3",
        "--max-tokens", "4", "--prompts-per-category", "1", "--context-len", "8", "--out", str(out), "--no-write",
    ])
    assert result.exit_code == 0, result.output
    figures = json.loads(out.read_text())
    assert len(calls) == 3 * 2 * 2  # rounds x batch sizes x (plain, 1x2)
    assert figures["rounds"] == 3
    assert figures["plain_step_s"] == {"1": pytest.approx(0.0044), "3": pytest.approx(0.0132)}
    assert figures["spec_step_s"] == {"1:1x2": pytest.approx(0.0132), "3:1x2": pytest.approx(0.0396)}
    assert figures["round_spread"]["1:plain"] == pytest.approx(4.0)
    assert "widest spread between rounds is 300%" in result.output and "moved during calibration" in result.output
    calls.clear()
    once = CliRunner().invoke(app, [  # one round: nothing to compare, so no spread is recorded
        "calibrate", "-c", str(config), "--batch-sizes", "1", "--shapes", "1x2", "--repeats", "1", "--rounds", "1",
        "--max-tokens", "4", "--prompts-per-category", "1", "--context-len", "8", "--out", str(out), "--no-write",
    ])
    assert once.exit_code == 0, once.output
    assert json.loads(out.read_text())["round_spread"] is None and "spread" not in once.output


def test_a_file_measured_with_another_kv_cache_dtype_is_not_overwritten_without_replace_other(tiny_config_path,
                                                                                               tmp_path):
    """Calibrating an int8-cache copy of a config whose file was measured on a float32 cache stops
    before measuring, naming both setups (replicas of the other setup read that file); a file of
    its own, or --replace-other, go ahead."""
    config = tiny_config_path.parent / "calibrate_int8_cache.yaml"
    config.write_text(tiny_config_path.read_text())
    out = tmp_path / "cal.json"
    held = {"compute_path": "x", "kv_cache_dtype": "float32", "plain_step_s": {"1": 0.01}}
    out.write_text(json.dumps(held))
    args = ["calibrate", "-c", str(config), "--batch-sizes", "1", "--shapes", "1x2", "--repeats", "1", "--rounds", "1",
            "--max-tokens", "4", "--prompts-per-category", "1", "--context-len", "8", "--no-write"]
    config.write_text(config.read_text().replace("num_threads: 1}", "num_threads: 1, kv_cache_dtype: int8}", 1))
    assert load_config(config).engine.kv_cache_dtype == "int8"
    refused = CliRunner().invoke(app, [*args, "--out", str(out)])
    assert refused.exit_code == 2, refused.output
    text = " ".join(refused.output.split())
    assert "kv_cache_dtype 'float32'" in text and "kv_cache_dtype 'int8'" in text and "--replace-other" in text
    assert json.loads(out.read_text()) == held  # untouched
    own = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "int8.json")])
    assert own.exit_code == 0, own.output
    assert json.loads((tmp_path / "int8.json").read_text())["kv_cache_dtype"] == "int8"
    forced = CliRunner().invoke(app, [*args, "--out", str(out), "--replace-other"])
    assert forced.exit_code == 0, forced.output
    assert json.loads(out.read_text())["kv_cache_dtype"] == "int8"
