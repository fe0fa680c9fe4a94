"""``rdserve`` CLI: config errors exit 2 naming the field; ``generate --json`` on the tiny model."""

import json

import pytest
import typer
from typer.testing import CliRunner

from cluster.cli.main import app

runner = CliRunner()

REQUIRED_KEYS = {"text", "token_ids", "num_steps", "accepted_draft_tokens", "tokens_per_step", "mode",
                 "prompt_tokens", "completion_tokens", "finish_reason", "latency_s"}


@pytest.mark.parametrize(
    "yaml_text, field",
    [
        ("speculation:\n  num_beams: 17\n", "speculation.num_beams"),
        ("engine:\n  num_beams: 2\n", "engine.num_beams: moved to speculation.num_beams"),
        ("engine:\n  backend: tensorrt_llm\n", "engine.backend"),
        ("speculation:\n  policy: table\n  table: [{max_batch_size: 4, num_beams: 2, draft_len_per_beam: 2},\n"
         "    {max_batch_size: 2, num_beams: 1, draft_len_per_beam: 1}]\n", "speculation.table"),
        ("drafter:\n  path: no/such/dir\n", "drafter.path"),
    ],
)
def test_up_with_bad_config_exits_2_naming_the_field(tmp_path, yaml_text, field):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml_text)
    result = runner.invoke(app, ["up", "--config", str(bad)])
    assert result.exit_code == 2
    assert field in result.output


COMMANDS = [[], ["up"], ["generate"], ["eval"], ["bench"], ["calibrate"], ["model"], ["model", "pull"], ["drafter"],
            ["drafter", "train"], ["drafter", "eval"]]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help_that_fits_80_columns(command):
    """Every option is shown whole at 80 columns (no "…"-truncated option names)."""
    result = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "80", "TERMINAL_WIDTH": "80"})
    assert result.exit_code == 0 and "Usage" in result.output
    assert "…" not in result.output and max(len(line) for line in result.output.splitlines()) <= 80
    for param in typer.main.get_command(app).commands.get(command[0], None).params if command else []:
        for opt in getattr(param, "opts", []):
            assert opt in result.output or param.hidden


def test_generate_json_lines(tiny_config_path, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "Once upon a time", "category": "story"}) + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "Hi"}]}) + "\n"
    )
    args = ["generate", "--config", str(tiny_config_path), "--prompts", str(prompts), "--max-tokens", "12", "--json"]
    for mode in ("spec", "plain"):
        result = runner.invoke(app, [*args, "--mode", mode])
        assert result.exit_code == 0, result.output
        lines = [json.loads(line) for line in result.stdout.splitlines()]
        assert len(lines) == 2
        for line in lines:
            assert REQUIRED_KEYS <= line.keys() and line["mode"] == mode
            assert line["completion_tokens"] == len(line["token_ids"]) <= 12
        assert lines[0]["category"] == "story" and "category" not in lines[1]


def test_generate_single_chat_prompt_as_text(tiny_config_path):
    result = runner.invoke(app, ["generate", "--config", str(tiny_config_path), "--prompt", "Hi", "--chat",
                                 "--max-tokens", "8", "--mode", "plain"])
    assert result.exit_code == 0, result.output
    assert "tokens/step" in result.output


def test_generate_needs_exactly_one_prompt_source(tiny_config_path):
    result = runner.invoke(app, ["generate", "--config", str(tiny_config_path), "--max-tokens", "8"])
    assert result.exit_code == 2 and "--prompt" in result.output


@pytest.mark.parametrize("args, option", [(["--gen-dtype", "float16"], "--gen-dtype"),
                                          (["--soft-weight", "2"], "--soft-weight"),
                                          (["--soft-weight", "-1"], "--soft-weight"),
                                          (["--head-type", "bogus"], "--head-type"), (["--steps", "0"], "--steps"),
                                          (["--lr", "0"], "--lr"), (["--num-beams", "0"], "--num-beams"),
                                          (["--gen-with", "gpu"], "--gen-with"),
                                          (["--also-train-on", "/nonexistent-shards"], "--also-train-on")])
def test_drafter_train_rejects_bad_options_before_any_work(tmp_path, args, option):
    result = runner.invoke(app, ["drafter", "train", "--out", str(tmp_path / "d"), *args])
    assert result.exit_code == 2 and option in result.output
    assert not (tmp_path / "d").exists()


def test_drafter_data_dir_refuses_other_generation_settings(tmp_path):
    """Shards are reused on re-runs, so a data dir remembers how its data was generated."""
    from workers.training.preflight import check_data_settings

    settings = {"model": "/m", "max_new_tokens": 16, "gen_dtype": "bfloat16", "max_prompt_tokens": 400}
    check_data_settings(tmp_path, settings)
    check_data_settings(tmp_path, settings)  # same settings: fine (resume)
    with pytest.raises(typer.BadParameter, match="max_new_tokens=16") as err:
        check_data_settings(tmp_path, {**settings, "max_new_tokens": 32})
    assert err.value.param_hint == "--max-new-tokens"
    with pytest.raises(typer.BadParameter, match="gen_dtype='bfloat16'"):
        check_data_settings(tmp_path, {**settings, "gen_dtype": "float32"})
    # data recorded before --gen-with existed came from the PyTorch model: engine data may not join it
    with pytest.raises(typer.BadParameter, match="gen_with='model'") as err:
        check_data_settings(tmp_path, {**settings, "gen_with": "engine:gguf-avx2-int8"})
    assert err.value.param_hint == "--gen-with"
    check_data_settings(tmp_path, {**settings, "gen_with": "model"})


@pytest.mark.parametrize("keys", [None, ["sk-test-0123456789"]])
def test_ready_message_curl_hint_carries_an_authorization_header_only_when_keys_are_on(tmp_path, capsys, keys):
    from cluster.cli.main import _print_ready
    from cluster.config import parse_config

    cfg = parse_config({"serve": {"api_keys": keys}} if keys else {}, tmp_path)
    _print_ready(cfg, "http://127.0.0.1:9")  # nothing listens there: the KV line is skipped
    out = capsys.readouterr().out
    curl = next(line for line in out.splitlines() if line.strip().startswith("curl "))
    assert ("Authorization: Bearer YOUR_KEY" in curl) == bool(keys)
    assert "sk-test-0123456789" not in out  # a key is never printed


def test_generate_prints_the_models_text_exactly(tiny_config_path):
    """Not wrapped at 80 columns when stdout is no terminal: the text equals --json's."""
    args = ["generate", "--config", str(tiny_config_path), "--prompt", "Once upon a time", "--max-tokens", "60",
            "--mode", "plain"]
    text = json.loads(runner.invoke(app, [*args, "--json"]).stdout)["text"]
    assert len(text) > 80
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(text + "\n")


def test_generate_prints_brackets_and_colons_of_the_text_as_they_are(tiny_config_path, monkeypatch):
    text = "[bold]not markup[/bold] :smile: [red]" + " word" * 30
    monkeypatch.setattr("cluster.cli.main._generate_one", lambda engine, item, params, mode: {
        "text": text, "completion_tokens": 1, "num_steps": 1, "tokens_per_step": 1.0, "latency_s": 0.1,
        "mode": mode, "finish_reason": "length"})
    result = runner.invoke(app, ["generate", "--config", str(tiny_config_path), "--prompt", "Hi", "--mode", "plain"])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(text + "\n")


@pytest.mark.parametrize("args, message", [
    (["--prompt", ""], "--prompt: the prompt is empty"),
    (["--prompt", "Hi", "--chat", "--max-tokens", "1000"], None),  # cut to the context: fine
    (["--prompt", "word " * 300], "shorten the prompt"),  # beyond max_seq_len 256
    (["--prompts", "/no/such/prompts.jsonl"], "/no/such/prompts.jsonl"),
])
def test_generate_user_input_errors_are_one_line_and_exit_2(tiny_config_path, args, message):
    result = runner.invoke(app, ["generate", "--config", str(tiny_config_path), "--mode", "plain", *args])
    if message is None:
        assert result.exit_code == 0, result.output
        return
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output


def test_generate_request_the_kv_cache_cannot_hold_names_what_to_change(tiny_config_path, tmp_path):
    small = tmp_path / "small.yaml"
    small.write_text(tiny_config_path.read_text().replace("num_threads: 1", "num_threads: 1, num_kv_blocks: 4")
                     .replace("path: model", f"path: {tiny_config_path.parent / 'model'}")
                     .replace("path: drafter", f"path: {tiny_config_path.parent / 'drafter'}"))
    result = runner.invoke(app, ["generate", "--config", str(small), "--prompt", "Hi", "--max-tokens", "200",
                                 "--mode", "plain"])
    assert result.exit_code == 2, result.output
    assert "KV slots" in result.output and "--max-tokens" in result.output and "engine.num_kv_blocks" in result.output


@pytest.mark.parametrize("line, message", [
    ({"prompt": 5}, "'prompt' must be a string"),
    ({"messages": [{"role": "user"}]}, "'messages' must be a list of {role, content} strings"),
    ({"messages": "Hi"}, "'messages' must be a list of {role, content} strings"),
])
def test_generate_rejects_malformed_prompt_lines(tiny_config_path, tmp_path, line, message):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps(line) + "\n")
    result = runner.invoke(app, ["generate", "--config", str(tiny_config_path), "--prompts", str(prompts)])
    assert result.exit_code == 2 and f"{prompts}:1: {message}" in result.output


def test_generate_max_seq_len_beyond_the_models_positions_is_a_config_error(tiny_config_path, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(tiny_config_path.read_text().replace("max_seq_len: 256", "max_seq_len: 4096")
                   .replace("path: model", f"path: {tiny_config_path.parent / 'model'}")
                   .replace("path: drafter", f"path: {tiny_config_path.parent / 'drafter'}"))
    for command in (["generate", "--prompt", "Hi", "--mode", "plain"], ["up"]):
        result = runner.invoke(app, [*command, "--config", str(bad)])
        assert result.exit_code == 2, result.output
        assert "config error" in result.output and "engine.max_seq_len: 4096" in result.output
        assert "max_position_embeddings 1024" in result.output


def test_generate_says_where_its_step_times_come_from():
    """The start-up line names the speculation settings and whether a calibration is trusted here."""
    from cluster.cli.main import speculation_line
    from workers.speculation.policy import SelectedPolicy

    source = "speculation.by_compute_path.gguf-avx2-int8.calibration"
    trusted = speculation_line(SelectedPolicy(None, source), "gguf-avx2-int8")
    assert source in trusted and "gguf-avx2-int8" in trusted and "trusted" in trusted
    measured = speculation_line(SelectedPolicy(None, source, measure_at_start=True), "gguf-avx2-int8")
    assert "measured at start" in measured and "trusted" not in measured
    fixed = speculation_line(SelectedPolicy(None, "speculation.table"), "cpu-float32")
    assert "trusted" not in fixed and "measured" not in fixed
