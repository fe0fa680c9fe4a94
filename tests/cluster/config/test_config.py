"""``cluster.config``: schema errors name the field; relative paths resolve against the YAML's directory."""

import re
from pathlib import Path

import pytest

from cluster.config import MOVED_KEYS, ConfigError, check_startable, load_config, parse_config

REPO = Path(__file__).resolve().parents[3]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_local_yaml_is_valid_from_any_cwd(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(REPO / "configs" / "local.yaml")
    assert cfg.model.name == "SmolLM2-135M-Instruct"
    assert cfg.model.path is None
    assert cfg.drafter.path == REPO / "workers" / "drafters" / "smollm2-135m-instruct"
    assert (cfg.drafter.path / "config.json").is_file() and (cfg.drafter.path / "model.safetensors").is_file()
    assert cfg.engine.max_seq_len == 2048
    assert (cfg.serve.port, cfg.serve.replicas) == (8000, 1)
    assert cfg.engine.weights == "auto"  # the default model's shipped GGUF blocks
    assert cfg.engine.prefill_dtype == "auto"


def test_tp_size_is_checked_against_the_pulled_default_model(tmp_path, monkeypatch):
    """With ``model.path: null`` the check reads the cached default model's config (9 heads, 3 KV heads)."""
    import json

    monkeypatch.setenv("RDSERVE_CACHE", str(tmp_path))
    model_dir = tmp_path / "models" / "SmolLM2-135M-Instruct"
    model_dir.mkdir(parents=True)
    (model_dir / "config.json").write_text(json.dumps({
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0, "tie_word_embeddings": True, "eos_token_id": 2}))
    with pytest.raises(ConfigError, match="engine.tp_size: tp_size=2 must divide num_attention_heads=9"):
        check_startable(parse_config({"engine": {"tp_size": 2}}, tmp_path), cuda_available=False)
    check_startable(parse_config({"engine": {"tp_size": 3}}, tmp_path), cuda_available=False)


@pytest.mark.parametrize("preset", sorted(p.name for p in (REPO / "configs").glob("*.yaml")))
def test_every_preset_is_startable(preset):
    cfg = load_config(REPO / "configs" / preset)
    if cfg.engine.device.startswith("cuda"):  # GPU presets (gpu-tp8): their model directories are placeholders
        with pytest.raises(ConfigError, match="engine.device"):
            check_startable(cfg, cuda_available=False)
        with pytest.raises(ConfigError, match="model.path: directory not found: /models/"):
            check_startable(cfg, cuda_available=True)
        return
    check_startable(cfg, cuda_available=False)
    assert cfg.drafter.path is None or (cfg.drafter.path / "config.json").is_file()


@pytest.mark.parametrize("preset", sorted(p.name for p in (REPO / "configs").glob("*.yaml")))
def test_keyed_calibrations_were_measured_on_their_key(preset):
    """A preset's speculation.by_compute_path calibration names a file `rdserve calibrate` wrote on
    that compute path (its "compute_path" field), so a replica never reads another path's step costs."""
    import json

    by_path = load_config(REPO / "configs" / preset).speculation.by_compute_path or {}
    for name, entry in by_path.items():
        if entry.calibration is not None:
            assert json.loads(entry.calibration.read_text())["compute_path"] == name, (preset, entry.calibration)


def test_relative_paths_resolve_against_the_config_directory(tmp_path):
    cfg = load_config(write(tmp_path, "model: {path: m}\ndrafter: {path: ../d}\n"))
    assert cfg.model.path == tmp_path / "m"
    assert cfg.drafter.path == tmp_path.parent / "d"


@pytest.mark.parametrize(
    "yaml_text, field",
    [
        ("speculation: {num_beams: 17}", "speculation.num_beams: Input should be less than or equal to 16"),
        ("speculation: {draft_len_per_beam: 0}", "speculation.draft_len_per_beam"),
        ("speculation: {policy: sometimes}", "speculation.policy: Input should be 'fixed', 'table', 'auto' or 'off' "
                                             r"\(got 'sometimes'\)"),
        ("engine: {kv_cache_dtype: INT8}", "engine.kv_cache_dtype: Input should be 'auto', 'float32', 'float16' or "
                                           r"'int8' \(got 'INT8'\)"),
        ("speculation: {policy: table}", "speculation.table: policy 'table' needs the rows"),
        ("speculation: {policy: fixed, table: off}",
         r"speculation.table: only read with policy 'table' \(policy is 'fixed'\)"),
        ("speculation: {policy: fixed, calibration: c.json}",
         r"speculation.calibration: only read with policy 'auto' or serve.pools \(policy is 'fixed'\)"),
        ("speculation: {policy: auto, calibration: c.json}", "speculation.policy: 'auto' needs drafter.path"),
        ("speculation: {policy: off, by_compute_path: {gguf-avx2: {table: [{max_batch_size: 1, num_beams: 1, "
         "draft_len_per_beam: 1}]}}}", "speculation.by_compute_path: not used with policy 'off'"),
        ("engine: {nmu_beams: 4}", "engine.nmu_beams: Extra inputs are not permitted"),
        ("engine: {device: tpu}", "engine.device"),
        ("engine: {dtype: float8}", "engine.dtype"),
        ("engine: {weights: q4}", "engine.weights: Input should be 'auto', 'gguf' or 'float32'"),
        ("engine: {prefill_dtype: fp8}", "engine.prefill_dtype: Input should be 'auto', 'float32' or 'bfloat16'"),
        ("engine: {prefill_dtype: bfloat16, weights: float32}", "engine.prefill_dtype: 'bfloat16' is for GGUF-block"),
        ("engine: {max_seq_len: 8}", "engine.max_seq_len"),
        ("engine: {decode_activations: int4}", "engine.decode_activations: Input should be 'auto', 'float32' or 'int8'"),
        ("engine: {decode_activations: int8, weights: float32}", "engine.decode_activations: 'int8' is for GGUF"),
        ("speculation: {prompt_lookup_num_tokens: -1}", "speculation.prompt_lookup_num_tokens"),
        ("speculation: {prompt_lookup_min: 4, prompt_lookup_max: 3}", "speculation.prompt_lookup_min: 4 is above"),
        ("speculation: {prompt_lookup_num_tokens: 0, prompt_lookup_max_num_tokens: 8}",
         "speculation.prompt_lookup_max_num_tokens: set, but speculation.prompt_lookup_num_tokens is 0"),
        ("engine: {max_num_tokens: 32}\nspeculation: {prompt_lookup_max_num_tokens: 32}",
         "engine.max_num_tokens: 32 cannot hold one draft tree"),
        ("speculation: {prompt_lookup_num_tokens: 4, prompt_lookup_max_num_tokens: 3}",
         "speculation.prompt_lookup_max_num_tokens: 3 is below"),
        ("engine: {backend: tensorrt_llm}\nspeculation: {prompt_lookup_num_tokens: 4}",
         "speculation.prompt_lookup_num_tokens: the prompt-lookup beam needs engine.backend torch"),
        ("speculation: {by_compute_path: {avx2: {table: off}}}", r"speculation.by_compute_path.avx2 \(key\): "
         "'avx2' is not a compute path: expected cuda or WEIGHTS-ISA"),
        ("speculation: {by_compute_path: {gguf-avx2: {table: [{max_batch_size: 0, num_beams: 1, "
         "draft_len_per_beam: 1}]}}}",
         "speculation.by_compute_path.gguf-avx2.table"),
        ("speculation: {policy: auto, calibration: c.json, by_compute_path: {gguf-avx2: {table: off}}}\n"
         "drafter: {path: d}", "speculation.by_compute_path.gguf-avx2.table: not used with policy 'auto' and "
         "speculation.calibration"),
        ("speculation: {policy: auto, by_compute_path: {avx2: {calibration: c.json}}}\ndrafter: {path: d}",
         r"speculation.by_compute_path.avx2 \(key\): 'avx2' is not a compute path"),
        ("speculation: {by_compute_path: {gguf-avx2: {calibration: c.json}}}",
         r"speculation.by_compute_path.gguf-avx2.calibration: only read with policy 'auto' \(policy is 'fixed'\)"),
        ("speculation: {policy: auto}\ndrafter: {path: d}",
         "speculation.calibration: policy 'auto' needs the calibration JSON"),
        ("speculation: {policy: auto, by_compute_path: {gguf-avx2: {calibration: c.json, table: off}}}\n"
         "drafter: {path: d}", "speculation.by_compute_path.gguf-avx2: give exactly one of table and "
         "calibration"),
        ("engine: {tp_size: 0}", "engine.tp_size"),
        ("speculation: {default_mode: fast}", "speculation.default_mode"),
        ("speculation: {spec_max_load: -1}", "speculation.spec_max_load"),
        ("serve: {replicas: 0}", "serve.replicas"),
        ("serve: {autoscaling: {min_replicas: 3, max_replicas: 2}}",
         "serve.autoscaling.max_replicas: must be >= min_replicas"),
        ("serve: {autoscaling: {min_replicas: 0}}", "serve.autoscaling.min_replicas"),
        ("serve: {autoscaling: {metrics_interval_s: 5, look_back_period_s: 5}}",
         "serve.autoscaling.look_back_period_s: must be longer than metrics_interval_s"),
        ("serve: {autoscaling: {kv_usage_target: 1.5}}", "serve.autoscaling.kv_usage_target"),
        ("serve: {autoscaling: {target_ongoing_requests: 0}}", "serve.autoscaling.target_ongoing_requests"),
        ("serve: {autoscaling: {slo_ttft_ms: -1}}", "serve.autoscaling.slo_ttft_ms"),
        ("serve: {autoscaling: {max_replica: 4}}", "serve.autoscaling.max_replica: Extra inputs are not permitted"),
        ("serve: {num_cpus_per_replica: 0}", "serve.num_cpus_per_replica"),
        ("serve: {colocate: true, replicas: 2}", "serve.colocate: true runs exactly one engine replica"),
        ("serve: {colocate: true, autoscaling: {max_replicas: 2}}", "serve.colocate: true runs exactly one"),
        ("serve: {colocate: true}\nengine: {tp_size: 2}", "serve.colocate: true is for engine.tp_size 1"),
        ("serve: {colocate: sometimes}", "serve.colocate"),
        ("serve: {colocate: 'yes'}", "serve.colocate"),  # a string is not a boolean here
        ("servr: {port: 1}", "servr: Extra inputs are not permitted"),
    ],
)
def test_errors_name_the_field(tmp_path, yaml_text, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(write(tmp_path, yaml_text + "\n"))


def test_several_errors_one_line_each(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, "speculation: {num_beams: 0}\nengine: {tp_size: 0}\n"))
    assert {"speculation.num_beams", "engine.tp_size"} <= {line.split(":")[0] for line in str(err.value).splitlines()}
    with pytest.raises(ConfigError) as err:  # a section's own check leads with the field it names
        load_config(write(tmp_path, "speculation: {policy: table}\nengine: {tp_size: 0}\n"))
    assert {"speculation.table", "engine.tp_size"} <= {line.split(":")[0] for line in str(err.value).splitlines()}


@pytest.mark.parametrize("section, key", list(MOVED_KEYS), ids=[f"{s}.{k}" for s, k in MOVED_KEYS])
def test_moved_keys_fail_naming_their_new_place(tmp_path, section, key):
    with pytest.raises(ConfigError, match=re.escape(f"{section}.{key}: moved to {MOVED_KEYS[section, key]}")):
        load_config(write(tmp_path, f"{section}: {{{key}: 1}}\n"))


@pytest.mark.parametrize("empty", ["router: {}\n", "router:\n"])
def test_an_empty_router_section_fails_naming_the_speculation_section(tmp_path, empty):
    with pytest.raises(ConfigError, match="router: moved to the speculation section"):
        load_config(write(tmp_path, empty))


def test_several_moved_keys_one_line_each(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, "engine: {num_beams: 2, spec_schedule: auto}\nrouter: {spec_max_load: 1}\n"))
    lines = str(err.value).splitlines()[1:]  # after the file's name
    assert [line.split(":")[0] for line in lines] == ["engine.num_beams", "engine.spec_schedule", "router.spec_max_load"]


def test_unreadable_and_non_mapping_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(write(tmp_path, "engine: [\n"))
    with pytest.raises(ConfigError, match="mapping"):
        load_config(write(tmp_path, "- 1\n"))


@pytest.mark.parametrize(
    "data, field",
    [
        ({"engine": {"backend": "tensorrt_llm"}}, "engine.backend: 'tensorrt_llm' needs a CUDA GPU"),
        ({"engine": {"device": "cuda:1"}}, "engine.device"),
        ({"model": {"path": "nowhere"}}, "model.path: directory not found"),
        ({"drafter": {"path": "nowhere"}}, "drafter.path: directory not found"),
    ],
)
def test_check_startable_names_the_field(tmp_path, data, field):
    with pytest.raises(ConfigError, match=field):
        check_startable(parse_config(data, tmp_path), cuda_available=False)


def test_calibrations_by_compute_path_resolve_and_fall_back(tmp_path):
    """Calibrations by compute path resolve against the config's directory; a path without an entry
    reads speculation.calibration; with calibrations by path and no speculation.calibration, tables
    serve the other paths."""
    from workers.speculation.policy import select_policy

    cfg = load_config(write(tmp_path, "speculation: {policy: auto, calibration: all.json, "
                            "by_compute_path: {gguf-avx2-int8: {calibration: ../a.json}}}\ndrafter: {path: d}\n"))
    assert cfg.speculation.calibration_for("gguf-avx2-int8") == tmp_path.parent / "a.json"
    assert cfg.speculation.calibration_for("cuda") == tmp_path / "all.json"
    assert set(cfg.speculation.calibration_files()) == {"speculation.calibration",
                                                        "speculation.by_compute_path.gguf-avx2-int8.calibration"}
    cfg = load_config(write(tmp_path, "speculation: {policy: auto, by_compute_path: {gguf-avx2-int8: {calibration: "
                            "a.json}, gguf-avx2: {table: off}}}\ndrafter: {path: d}\n"))
    assert cfg.speculation.calibration_for("gguf-avx2") is None
    assert select_policy(cfg.speculation, "gguf-avx2", 16).source == "speculation.by_compute_path.gguf-avx2.table"


def test_check_startable_reads_every_keyed_calibration(tmp_path):
    import json

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text("{}")
    (tmp_path / "bad.json").write_text("{}")
    avx2_int8 = REPO / "configs" / "local.calibration.avx2-int8.json"

    def by_compute_path(entries):
        return parse_config({"drafter": {"path": "d"}, "speculation": {"policy": "auto", "by_compute_path": {
            name: {"calibration": str(path)} for name, path in entries.items()}}}, tmp_path)

    cfg = by_compute_path({"gguf-avx2-int8": avx2_int8, "cuda": "bad.json"})
    with pytest.raises(ConfigError, match=r"speculation\.by_compute_path\.cuda\.calibration: .*bad\.json: not a usable "
                                          "calibration"):
        check_startable(cfg, cuda_available=False)
    with pytest.raises(ConfigError, match=r"speculation\.by_compute_path\.gguf-avx2\.calibration: .* was measured on "
                                          "compute path gguf-avx2-int8, not gguf-avx2"):
        check_startable(by_compute_path({"gguf-avx2": avx2_int8}), cuda_available=False)
    older = json.loads(avx2_int8.read_text())  # files written before the rename say "kernel"
    older["kernel"] = older.pop("compute_path")
    (tmp_path / "older.json").write_text(json.dumps(older))
    with pytest.raises(ConfigError, match=r"speculation\.by_compute_path\.gguf-avx2\.calibration: .* was measured on "
                                          "compute path gguf-avx2-int8, not gguf-avx2"):
        check_startable(by_compute_path({"gguf-avx2": "older.json"}), cuda_available=False)
    check_startable(by_compute_path({"gguf-avx2-int8": "older.json"}), cuda_available=False)


def test_check_startable_accepts_the_defaults(tmp_path):
    check_startable(parse_config({}, tmp_path), cuda_available=False)


def test_autoscaling_is_off_unless_configured(tmp_path):
    assert load_config(write(tmp_path, "serve: {replicas: 2}\n")).serve.autoscaling is None
    scaling = load_config(write(tmp_path, "serve: {autoscaling: {max_replicas: 4}}\n")).serve.autoscaling
    assert (scaling.min_replicas, scaling.max_replicas, scaling.kv_usage_target, scaling.slo_ttft_ms) == (1, 4, 0.85, None)
    assert scaling.look_back_period_s > scaling.metrics_interval_s and scaling.graceful_shutdown_timeout_s >= 600


def test_autoscale_yaml_scales_one_to_two_replicas_quickly():
    cfg = load_config(REPO / "configs" / "autoscale.yaml")
    scaling = cfg.serve.autoscaling
    assert (scaling.min_replicas, scaling.max_replicas) == (1, 2)
    assert scaling.upscale_delay_s + scaling.downscale_delay_s + scaling.look_back_period_s <= 120
    local = load_config(REPO / "configs" / "local.yaml")
    assert (cfg.model, cfg.drafter, cfg.engine.model_dump(exclude={"num_threads"})) == (
        local.model, local.drafter, local.engine.model_dump(exclude={"num_threads"}))


@pytest.mark.parametrize("yaml_text, colocated", [
    ("", True),  # one fixed replica: the engine runs in the ingress's process
    ("serve: {colocate: false}", False),
    ("serve: {replicas: 2}", False),
    ("serve: {autoscaling: {max_replicas: 2}}", False),
    ("engine: {tp_size: 2}", False),  # ranks are placed as a separate deployment
    ("serve: {colocate: true}", True),
])
def test_colocate_auto_means_exactly_one_engine_replica(tmp_path, yaml_text, colocated):
    cfg = load_config(write(tmp_path, yaml_text + "\n"))
    assert cfg.serve.colocated(cfg.engine.tp_size) is colocated


def test_draft_search_is_validated_and_needs_backend_torch(tmp_path):
    """'distinct_first' is the default; a bad value names the field; TensorRT-LLM drafts by beam search."""
    assert load_config(write(tmp_path, "drafter: {path: d}\n")).speculation.draft_search == "distinct_first"
    with pytest.raises(ValueError, match=r"speculation\.draft_search"):
        load_config(write(tmp_path, "speculation: {draft_search: greedy}\ndrafter: {path: d}\n"))
    with pytest.raises(ValueError, match=r"speculation\.draft_search: 'distinct_first' needs engine\.backend torch"):
        load_config(write(tmp_path, "engine: {backend: tensorrt_llm}\nspeculation: {draft_search: distinct_first, "
                                    "prompt_lookup_num_tokens: 0}\ndrafter: {path: d}\n"))
    cfg = load_config(write(tmp_path, "engine: {backend: tensorrt_llm}\nspeculation: {draft_search: beam, "
                                      "prompt_lookup_num_tokens: 0}\ndrafter: {path: d}\n"))
    assert cfg.speculation.draft_search == "beam"


def test_max_seq_len_beyond_the_models_positions_fails_at_start(tmp_path):
    """Known once the model's config.json is read: check_startable (`rdserve up`/`generate`) and
    build_engine (a default model pulled after the check) name the field and the model's limit."""
    import json

    from cluster.replica.build import build_engine

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 8192}))
    cfg = load_config(write(tmp_path, "model: {path: m}\nengine: {max_seq_len: 100000}\n"))
    limit = "engine.max_seq_len: 100000 is above the model's max_position_embeddings 8192"
    with pytest.raises(ConfigError, match=limit):
        check_startable(cfg, cuda_available=False)
    with pytest.raises(ConfigError, match=limit):
        build_engine(cfg)
    check_startable(load_config(write(tmp_path, "model: {path: m}\nengine: {max_seq_len: 8192}\n")), cuda_available=False)
    (tmp_path / "m" / "config.json").write_text(json.dumps({"max_position_embeddings": 8192}))
    with pytest.raises(ConfigError, match="model.path: .*config.json has no 'vocab_size'"):
        check_startable(cfg, cuda_available=False)


def test_num_threads_above_the_cores_warns_and_uses_the_cores(tmp_path, monkeypatch, caplog):
    from cluster.replica.build import num_threads

    monkeypatch.setattr("os.cpu_count", lambda: 4)
    cfg = load_config(write(tmp_path, "engine: {num_threads: 1000}\n"))
    assert num_threads(cfg) == 4
    assert "engine.num_threads 1000 is above this machine's 4 CPUs" in caplog.text
    caplog.clear()
    assert num_threads(load_config(write(tmp_path, "engine: {num_threads: 4}\n"))) == 4
    assert not caplog.text


def test_a_key_given_twice_is_refused(tmp_path):
    """A second ``speculation:`` pasted at the end of a file would silently replace the first (PyYAML keeps
    the last); the config refuses it instead."""
    with pytest.raises(ConfigError, match="'speculation' appears twice"):
        load_config(write(tmp_path, "speculation: {policy: off}\nspeculation: {spec_max_load: 2}\n"))


def test_old_shapes_of_moved_sections_get_a_hint(tmp_path):
    with pytest.raises(ConfigError, match=r"speculation.by_compute_path.gguf-avx2: expected \{table: ROWS\} or "
                                          r"\{calibration: FILE\}"):
        load_config(write(tmp_path, "speculation: {policy: auto, by_compute_path: {gguf-avx2: c.json}}\n"
                                    "drafter: {path: d}\n"))
    with pytest.raises(ConfigError, match=r"router.foo: the router section moved to speculation"):
        load_config(write(tmp_path, "router: {foo: 1}\n"))
