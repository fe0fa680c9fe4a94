"""``rdserve calibrate`` on the tiny model: measures, derives, and writes a loadable schedule."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from cluster.cli import app
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
    assert figures["draft_search"] == load_config(config).engine.draft_search  # what the tokens per step were measured with
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
    assert written.engine.spec_schedule == table
    rows = [] if table == "off" else [r for r in table if r.num_beams]
    assert written.router.spec_max_load == max((r.max_batch_size for r in rows), default=0)
    assert "derived by `rdserve calibrate`" in config.read_text()
    again = CliRunner().invoke(app, [  # calibrating a calibrated config replaces the table and its note
        "calibrate", "-c", str(config), "--batch-sizes", "1", "--shapes", "1x2", "--repeats", "1",
        "--max-tokens", "4", "--prompts-per-category", "1", "--context-len", "8", "--out", str(out),
    ])
    assert again.exit_code == 0, again.output
    assert load_config(config).engine.spec_schedule == derive_schedule(
        {1: json.loads(out.read_text())["plain_step_s"]["1"]}, {(1, (1, 2)): json.loads(out.read_text())["spec_step_s"]["1:1x2"]},
        {(1, 2): json.loads(out.read_text())["tokens_per_step"]["1x2"]})
    assert config.read_text().count("derived by `rdserve calibrate`") == 1
    assert figures["spec_schedule"] == ("off" if table == "off" else [r.model_dump() for r in table])


def test_calibrate_rejects_a_bad_shape(tiny_config_path):
    result = CliRunner().invoke(app, ["calibrate", "-c", str(tiny_config_path), "--shapes", "2by2"])
    assert result.exit_code == 2
    assert "expected NUM_BEAMSxDRAFT_LEN" in result.output


def test_calibrate_fills_the_entry_of_the_kernel_it_ran_on(tiny_config_path, tmp_path):
    """With engine.spec_schedule_by_kernel in the config, the table goes under the kernel measured;
    the other kernels' entries, spec_schedule and router.spec_max_load stay as they were."""
    import yaml

    data = yaml.safe_load(tiny_config_path.read_text())
    other = [{"max_batch_size": 7, "num_beams": 2, "draft_len_per_beam": 2}]
    data["engine"]["spec_schedule_by_kernel"] = {"gguf-avx512-int8": other}
    data["engine"]["spec_schedule"] = [{"max_batch_size": 3, "num_beams": 1, "draft_len_per_beam": 1}]
    data.setdefault("router", {})["spec_max_load"] = 3
    config = tiny_config_path.parent / "calibrate_by_kernel.yaml"
    config.write_text(yaml.safe_dump(data))
    out = tmp_path / "cal.json"
    result = CliRunner().invoke(app, [
        "calibrate", "-c", str(config), "--batch-sizes", "1,2", "--shapes", "1x2", "--repeats", "1",
        "--max-tokens", "4", "--prompts-per-category", "1", "--context-len", "8", "--out", str(out),
    ])
    assert result.exit_code == 0, result.output
    figures = json.loads(out.read_text())
    kernel = figures["kernel"]
    assert kernel.startswith(("float32-", "gguf-")) and f"engine.spec_schedule_by_kernel.{kernel} written" in result.output
    written = load_config(config)
    assert written.engine.spec_schedule_by_kernel[kernel] == (
        "off" if figures["spec_schedule"] == "off" else [type(written.engine.spec_schedule[0])(**r) for r in figures["spec_schedule"]])
    assert [r.model_dump() for r in written.engine.spec_schedule_by_kernel["gguf-avx512-int8"]] == other
    assert [r.model_dump() for r in written.engine.spec_schedule] == [{"max_batch_size": 3, "num_beams": 1, "draft_len_per_beam": 1}]
    assert written.router.spec_max_load == 3


def test_writing_one_kernels_entry_keeps_the_others_and_their_comments(tmp_path):
    from cluster.calibrate_cli import _write_kernel_entry, _yaml_rows

    text = """engine:
  spec_schedule_by_kernel:
    # laptops
    gguf-avx2:
    - {max_batch_size: 2, num_beams: 1, draft_len_per_beam: 2}
    # servers: keep
    gguf-avx512-int8:
    - {max_batch_size: 2, num_beams: 1, draft_len_per_beam: 2}
    float32-avx2: off
    # the router follows the schedule
router:
  spec_max_load: 2
"""
    config = tmp_path / "c.yaml"
    rows = [{"max_batch_size": 4, "num_beams": 2, "draft_len_per_beam": 2}]
    for kernel, value in (("gguf-avx2", rows), ("float32-avx2", "off"), ("float32-torch", rows)):
        config.write_text(text)
        _write_kernel_entry(config, "spec_schedule_by_kernel", kernel, _yaml_rows(value), "new note")
        written = config.read_text()
        for comment in ("# laptops", "# servers: keep", "# the router follows the schedule"):
            assert comment in written, (kernel, written)
        assert ("# new note" in written) == (kernel == "float32-torch"), written  # only a new entry gets the note
        table = load_config(config).engine.spec_schedule_by_kernel
        assert (table[kernel] if value == "off" else [r.model_dump() for r in table[kernel]]) == value
        assert [r.model_dump() for r in table["gguf-avx512-int8"]] == [
            {"max_batch_size": 2, "num_beams": 1, "draft_len_per_beam": 2}]
        assert load_config(config).router.spec_max_load == 2


def test_calibrate_adds_the_calibration_of_the_kernel_it_ran_on(tiny_config_path):
    """spec_schedule 'auto' with calibrations keyed by compute path: a path without an entry gets a
    new file next to the config and its entry; a second run rewrites that file and leaves the config."""
    import yaml

    first = tiny_config_path.parent / "first.calibration.json"
    data = yaml.safe_load(tiny_config_path.read_text())
    data["engine"].update(spec_schedule="auto", spec_calibration_by_kernel={"gguf-avx512-int8": first.name})
    config = tiny_config_path.parent / "calibrate_auto.yaml"
    config.write_text(yaml.safe_dump(data))
    args = ["calibrate", "-c", str(config), "--batch-sizes", "1", "--shapes", "1x2", "--repeats", "1",
            "--max-tokens", "4", "--prompts-per-category", "1", "--context-len", "8"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    written = load_config(config)
    kernel = next(k for k in written.engine.spec_calibration_by_kernel if k != "gguf-avx512-int8")
    out = tiny_config_path.parent / f"calibrate_auto.calibration.{kernel}.json"
    assert written.engine.spec_calibration_by_kernel == {"gguf-avx512-int8": first, kernel: out}
    assert json.loads(out.read_text())["kernel"] == kernel
    assert f"{kernel}: {out.name}" in config.read_text()  # relative to the config, as a user writes it
    elsewhere = CliRunner().invoke(app, [*args, "--out", str(config.parent / "missing-dir" / "x.json")])
    assert elsewhere.exit_code == 2 and "does not exist" in elsewhere.output  # before any measuring
    before = config.read_text()
    out.write_text("{}")
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 0, again.output
    assert config.read_text() == before and f"engine.spec_calibration_by_kernel.{kernel}" in again.output
    assert json.loads(out.read_text())["kernel"] == kernel


def test_calibrate_without_write_says_a_new_path_is_not_read(tiny_config_path):
    import yaml

    data = yaml.safe_load(tiny_config_path.read_text())
    data["engine"].update(spec_schedule="auto", spec_calibration_by_kernel={"cuda": "cuda.json"})
    config = tiny_config_path.parent / "calibrate_nowrite.yaml"
    config.write_text(yaml.safe_dump(data))
    result = CliRunner().invoke(app, ["calibrate", "-c", str(config), "--batch-sizes", "1", "--shapes", "1x2",
                                      "--repeats", "1", "--max-tokens", "4", "--prompts-per-category", "1",
                                      "--context-len", "8", "--no-write"])
    assert result.exit_code == 0, result.output
    assert "not read at start" in result.output and "no engine.spec_calibration_by_kernel." in " ".join(result.output.split())
    assert load_config(config).engine.spec_calibration_by_kernel == {"cuda": config.parent / "cuda.json"}


def test_a_calibration_measured_elsewhere_or_with_another_draft_search_is_reported(tmp_path, caplog):
    from cluster.local_engine import _warn_if_measured_elsewhere

    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"kernel": "gguf-avx2-int8", "draft_search": "beam"}))
    with caplog.at_level("WARNING", logger="cluster.local_engine"):
        _warn_if_measured_elsewhere(cal, "gguf-avx2-int8", draft_search="beam")
        assert not caplog.records
        _warn_if_measured_elsewhere(cal, "gguf-avx512-int8", draft_search="distinct_first")
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "measured on kernel gguf-avx2-int8" in text and "engine.draft_search beam" in text and len(caplog.records) == 2
