"""``rdserve calibrate``: derive the speculation table from step costs measured on this machine.

Measures, with the engine the config describes: seconds per generation iteration for each batch
size, plain and for each draft-tree shape; greedy tokens per step of each shape on prompts (a JSONL
file, or rdserve's built-in held-out prompts). :func:`workers.speculation.schedule.derive_schedule` then
picks, per batch size, the shape with the highest expected tokens/s or plain decoding; the table is
written into the config as ``speculation.policy: table`` with ``speculation.table``, and the largest
batch size that still speculates as ``speculation.spec_max_load`` (requests arriving above it are
decoded plain), or, where the config keys tables by compute path, as
``speculation.by_compute_path.PATH.table``. With ``speculation.policy: auto`` the figures themselves
are the policy's input (the goodput model, :mod:`workers.speculation.goodput`): they go to
``speculation.calibration`` and the config is unchanged, or, where the config keys calibrations by
compute path, to the entry of the path measured (a new file next to the config, and a new entry
with ``--write``).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

console = Console()
err_console = Console(stderr=True)


def _parse_shapes(text: str) -> list[tuple[int, int]]:
    from workers.speculation.shape import DraftShape

    try:
        return DraftShape.parse_list(text)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None


def _parse_batches(text: str) -> list[int]:
    try:
        sizes = sorted({int(x) for x in text.split(",")})
    except ValueError:
        raise typer.BadParameter(f"'{text}': expected comma-separated integers, e.g. 1,2,4,8") from None
    if sizes[0] < 1:
        raise typer.BadParameter("batch sizes must be >= 1")
    return sizes


def _prompts(engine, path: Path | None, per_category: int) -> list[list[int]]:
    if path is not None:
        from cluster.evaluation.prompts import load_prompts

        rows, seen = [], {}
        for r in load_prompts(path):  # the first per_category of each category, in file order
            seen[r.category] = seen.get(r.category, 0) + 1
            if seen[r.category] <= per_category:
                rows.append(r)
        return [engine.encode_chat(r.messages) if r.messages is not None else engine.encode_prompt(r.prompt)
                for r in rows]
    from workers.training.prompt_sources import build_prompts, first_per_category

    by_cat = first_per_category(build_prompts(None, "heldout"), per_category)
    return [engine.encode_chat(p["messages"]) for rows in by_cat.values() for p in rows]


def calibrate(
    config: Path = typer.Option(..., "--config", "-c", help="YAML config; its engine (model, drafter, dtype, "
                                "threads) is what gets measured."),
    batch_sizes: str = typer.Option("1,2,4,8,16", help="Generation batch sizes to measure."),
    shapes: str = typer.Option("1x2,2x2,2x3,4x4", help="Draft-tree shapes NUM_BEAMSxDRAFT_LEN to consider."),
    prompts: Path | None = typer.Option(None, help="JSONL prompts ('prompt' or 'messages') for tokens per "
                                        "step; default: rdserve's built-in held-out chat and code prompts."),
    prompts_per_category: int = typer.Option(4, min=1, help="Prompts per category (built-in, or the first of "
                                             "each category of --prompts)."),
    max_tokens: int = typer.Option(64, min=2, help="Tokens generated per prompt for tokens per step."),
    context_len: int = typer.Option(256, min=1, help="Cached tokens per request while timing steps (the "
                                    "prompts' text, joined: draft trees then take the shapes real text gives them)."),
    repeats: int = typer.Option(6, min=1, help="Timed iterations per measurement (median)."),
    rounds: int = typer.Option(3, min=1, help="Times the whole step-cost sweep runs, one after another; each "
                               "figure is the median of its rounds, so (with 3 or more) a slow spell of the machine "
                               "shorter than a round does not decide it; 2 averages the two. Each figure's max/min "
                               "ratio across rounds is recorded (round_spread) and the widest printed."),
    out: Path | None = typer.Option(None, help="Where to write every measured figure (JSON); default with "
                                    "speculation.policy 'auto': the config's speculation.by_compute_path entry of the "
                                    "path measured (if the config has that section; a new one: CONFIG_STEM.calibration."
                                    "COMPUTE_PATH.json next to the config), else speculation.calibration; otherwise "
                                    "calibration.json."),
    write: bool = typer.Option(True, "--write/--no-write", help="Write the result into the config "
                               "(comments and the other keys are kept). Policy 'auto' with "
                               "speculation.by_compute_path: the file as the entry of the path measured, if new. "
                               "Otherwise the derived table: as speculation.by_compute_path.PATH.table for the "
                               "compute path measured (e.g. gguf-avx2-int8) when the config has that section, else "
                               "as speculation.policy 'table', speculation.table and speculation.spec_max_load."),
    replace_other: bool = typer.Option(False, "--replace-other", help="Overwrite an output file that holds figures "
                                       "measured on another compute path or KV cache dtype (without it, calibrate "
                                       "stops before measuring: replicas of that other setup read that file; a "
                                       "file measured on another thread count, another machine's, is replaced)."),
) -> None:
    """Measure step costs and acceptance here; derive and write the speculation table (or, with policy auto, the calibration file)."""
    from cluster.cli.common import startable_config, with_model_dir
    from cluster.replica.build import build_engine
    from workers.code_version import code_version
    from workers.speculation.calibration import measure_step_s, measure_tokens_per_step
    from workers.speculation.schedule import derive_schedule

    cfg = startable_config(config, calibration=False)
    spec = cfg.speculation
    auto = spec.policy == "auto"
    by_path = spec.by_compute_path is not None
    calibrations = {k: v.calibration for k, v in spec.by_compute_path.items() if v.calibration is not None} \
        if auto and by_path else None  # keyed by path: the entry is found once the path is known
    cfg_auto_files = (calibrations, spec.calibration)
    if out is None and calibrations is None:
        out = spec.calibration if auto else Path("calibration.json")
    if cfg.drafter.path is None:
        err_console.print("calibrate needs drafter.path in the config (there is nothing to schedule without it)")
        raise typer.Exit(2)
    batches, shape_list = _parse_batches(batch_sizes), _parse_shapes(shapes)
    cfg.engine = cfg.engine.model_copy(update={"max_batch_size": max(cfg.engine.max_batch_size, batches[-1]),
                                               "adaptive_threads": False})  # step costs on num_threads, not a mix
    cfg.speculation = spec.model_copy(update={"policy": "fixed", "table": None, "calibration": None,
                                              "by_compute_path": None})  # each measurement sets its shape
    engine = build_engine(with_model_dir(cfg))
    new_entry = calibrations is not None and engine.compute_path not in calibrations
    if out is None:
        out = calibrations.get(engine.compute_path) or config.resolve().parent / f"{config.stem}.calibration.{engine.compute_path}.json"
    if not out.parent.is_dir():  # before minutes of measuring, not after
        err_console.print(f"cannot write {out}: directory {out.parent} does not exist")
        raise typer.Exit(2)
    here = {"compute_path": engine.compute_path, "kv_cache_dtype": engine.step_conditions["kv_cache_dtype"]}
    if (other := _other_setup(out, here)) and not replace_other:
        err_console.print(f"{out} holds figures measured with {other}; this engine runs with "
                          + ", ".join(f"{k} {here[k]!r}" for k in sorted(here)) + ". Replicas of that setup read "
                          "that file: pass --out for a file of this setup's own (and point the config at it), or "
                          "--replace-other to overwrite it.")
        raise typer.Exit(2)
    all_ids = _prompts(engine, prompts, prompts_per_category)
    prompt_ids = [ids for ids in all_ids if len(ids) + max_tokens <= engine.max_seq_len]
    if len(prompt_ids) < len(all_ids):
        console.print(f"skipping {len(all_ids) - len(prompt_ids)} of {len(all_ids)} prompts longer than "
                      f"max_seq_len {engine.max_seq_len} - max_tokens {max_tokens}")
    if not prompt_ids:
        err_console.print("no prompt fits the context; pass shorter --prompts or a smaller --max-tokens")
        raise typer.Exit(2)
    plain_s, spec_s, tps = {}, {}, {}
    with Progress(console=console) as progress:
        task = progress.add_task("tokens per step", total=len(shape_list))
        for shape in shape_list:
            tps[shape] = measure_tokens_per_step(engine, prompt_ids, shape, max_tokens=max_tokens)
            progress.advance(task)
        task = progress.add_task("step costs", total=rounds * len(batches) * (1 + len(shape_list)))
        samples: dict[tuple, list[float]] = {}  # (b, shape or None) -> one median per round
        for _ in range(rounds):
            for b in batches:
                for shape in [None, *shape_list]:
                    samples.setdefault((b, shape), []).append(measure_step_s(
                        engine, b, shape, context_len=context_len, repeats=repeats, prompts=prompt_ids))
                    progress.advance(task)
    for (b, shape), values in samples.items():
        if shape is None:
            plain_s[b] = statistics.median(values)
        else:
            spec_s[b, shape] = statistics.median(values)
    spread = {(b, shape): max(v) / min(v) for (b, shape), v in samples.items()}
    worst = max(spread, key=spread.get)
    if rounds > 1:
        console.print(f"step costs: median of {rounds} rounds; the widest spread between rounds is "
                      f"{(spread[worst] - 1) * 100:.0f}% (batch {worst[0]}, {worst[1] or 'plain'})"
                      + ("; the machine's speed moved during calibration: consider more --rounds on a quieter "
                         "machine" if spread[worst] > 1.2 else ""))
    table = derive_schedule(plain_s, spec_s, tps)
    _print(batches, shape_list, plain_s, spec_s, tps, table)
    rows = "off" if table == "off" else [r.model_dump() for r in table]
    console.print(f"compute path: {engine.compute_path}")
    replaced = out.exists()
    out.write_text(json.dumps({
        "compute_path": engine.compute_path, "code_version": code_version(), **engine.step_conditions,
        "draft_search": engine.speculation.draft_search,
        "prompt_lookup_num_tokens": engine.lookup.num_tokens if engine.lookup else 0,
        "batch_sizes": batches, "context_len": context_len, "repeats": repeats, "rounds": rounds,
        # each figure's max / min across rounds (None with one round: nothing to compare)
        "round_spread": {f"{b}:{s or 'plain'}": round(v, 4) for (b, s), v in spread.items()} if rounds > 1 else None,
        "tokens_per_step": {str(s): v for s, v in tps.items()},
        "plain_step_s": plain_s,
        "spec_step_s": {f"{b}:{s}": v for (b, s), v in spec_s.items()},
        "table": rows,
    }, indent=1))
    console.print(f"figures written to {out}" + (" [bold](replacing the figures it held)[/]" if replaced else ""))
    path = engine.compute_path
    if calibrations is not None and new_entry and write:
        _write_path_entry(config, path, "calibration", _config_relative(out, config),
                          f"`rdserve calibrate`: batch sizes {batch_sizes}, shapes {shapes}")
        console.print(f"speculation.by_compute_path.{path}.calibration written to {config}: replicas on this "
                      "path read it at start (the goodput model)")
    elif auto:
        _report_auto_file(cfg_auto_files, path, out, config)
    elif write and by_path:
        _write_path_entry(config, path, "table", _yaml_rows(rows),
                          f"`rdserve calibrate` ({out.name}): batch sizes {batch_sizes}, shapes {shapes}")
        console.print(f"speculation.by_compute_path.{path}.table written to {config}")
    elif write:
        _write_schedule(config, rows, f"derived by `rdserve calibrate` ({out.name}): batch sizes {batch_sizes}, "
                                      f"shapes {shapes}")
        console.print(f"speculation.policy, speculation.table and speculation.spec_max_load written to {config}")


def _other_setup(out: Path, here: dict) -> str:
    """The settings ``out`` (an existing calibration file) was measured with that differ from
    ``here`` (compute path, KV cache dtype), as text; "" when none differ or the file
    is absent or unreadable (then it is replaced as before)."""
    try:
        held = json.loads(out.read_text())
    except (OSError, ValueError):
        return ""
    if not isinstance(held, dict):
        return ""
    return ", ".join(f"{k} {held[k]!r}" for k in sorted(here) if k in held and held[k] != here[k])


def _report_auto_file(files: tuple, path: str, out: Path, config: Path) -> None:
    """Say whether replicas on compute path ``path`` will read ``out`` (policy 'auto', config
    unchanged): ``files`` is (the by_compute_path calibrations or None, speculation.calibration)."""
    by_path, single = files
    field, read = (f"speculation.by_compute_path.{path}.calibration", by_path[path]) if path in (by_path or {}) \
        else ("speculation.calibration", single)
    if read is not None and read.resolve() == out.resolve():
        console.print("speculation.policy is 'auto': the goodput model reads the step costs and tokens per step "
                      f"from {out} at start ({field}); the config is left as it is")
    elif by_path is not None and read is None:
        console.print(f"[bold]not read at start[/]: the config has no speculation.by_compute_path.{path} entry (run "
                      f"again with --write, or add `{path}: {{calibration: {_config_relative(out, config)}}}` there)")
    else:
        console.print(f"[bold]not read at start[/]: replicas on {path} read {field} ({read}); the config is left "
                      "as it is")


def spec_max_load(rows) -> int:
    """The per-request mode's threshold (``speculation.spec_max_load``) matching a schedule (rows as dicts, or ``"off"``): the largest batch
    size that still speculates."""
    from workers.speculation.schedule import largest_speculating_batch, validate_schedule

    return largest_speculating_batch(validate_schedule(rows))


def _yaml_rows(rows):
    """A schedule as ruamel round-trip YAML: flow-style rows, or a quoted ``"off"``."""
    from ruamel.yaml.comments import CommentedMap, CommentedSeq
    from ruamel.yaml.scalarstring import DoubleQuotedScalarString

    if rows == "off":
        return DoubleQuotedScalarString("off")  # unquoted, YAML 1.1 readers see the boolean false
    value = CommentedSeq()
    for row in rows:
        m = CommentedMap(row)
        m.fa.set_flow_style()
        value.append(m)
    return value


def _round_trip(config: Path):
    """(ruamel YAML, the file's data) for an edit that keeps comments."""
    from ruamel.yaml import YAML
    from ruamel.yaml.comments import CommentedMap

    rt = YAML()
    rt.representer.add_representer(type(None), lambda r, _: r.represent_scalar("tag:yaml.org,2002:null", "null"))
    return rt, rt.load(config.read_text()) or CommentedMap()


def _config_relative(path: Path, config: Path) -> str:
    """``path`` as a config entry: relative to the config's directory when inside it."""
    path, base = path.resolve(), config.resolve().parent
    return str(path.relative_to(base)) if path.is_relative_to(base) else str(path)


def _write_path_entry(config: Path, path: str, key: str, new, note: str) -> None:
    """Set ``speculation.by_compute_path.<path>`` to ``{key: new}`` (``key`` ``table``: round-trip YAML
    rows or ``"off"``; ``calibration``: a file name) in the YAML file, keeping the rest (comments
    included; a new entry gets ``note`` as its comment, an existing one keeps its own)."""
    from ruamel.yaml.comments import CommentedMap, CommentedSeq

    rt, data = _round_trip(config)
    spec = data.setdefault("speculation", CommentedMap())
    table = spec.get("by_compute_path")
    if not isinstance(table, CommentedMap):
        table = spec["by_compute_path"] = CommentedMap()
    table.fa.set_block_style()  # `{}` in the file: rows and notes read better in block style
    existed = path in table
    entry = table.get(path)
    if not isinstance(entry, CommentedMap):
        entry = table[path] = CommentedMap()
    old = entry.get(key)
    # ruamel keeps the full-line comments that follow an entry on its rows' sequence: refill that
    # sequence in place, so that no other entry loses the note above it
    if isinstance(old, CommentedSeq) and isinstance(new, CommentedSeq):
        last = old.ca.items.get(len(old) - 1)
        del old[:]
        old.extend(new)
        if last is not None:
            old.ca.items[len(old) - 1] = last
    else:
        for other in [k for k in entry if k != key]:  # an entry holds a table or a calibration, not both
            del entry[other]
        entry[key] = new
    if not existed:
        table.yaml_add_eol_comment(note, path)
    with config.open("w") as f:
        rt.dump(data, f)


def _write_schedule(config: Path, rows, note: str) -> None:
    """Set ``speculation.policy`` ('table', or 'off' for an all-off table), ``speculation.table`` and
    ``speculation.spec_max_load`` in the YAML file, keeping its comments and other keys (round trip)."""
    from ruamel.yaml.comments import CommentedMap

    rt, data = _round_trip(config)
    spec = data.setdefault("speculation", CommentedMap())
    spec["policy"] = _yaml_rows("off") if rows == "off" else "table"
    spec.ca.items.pop("policy", None)  # replace the note of an earlier calibration
    spec.yaml_add_eol_comment(note, "policy")
    if rows == "off":
        spec.pop("table", None)
    else:
        spec["table"] = _yaml_rows(rows)
    spec["spec_max_load"] = spec_max_load(rows)
    spec.ca.items.pop("spec_max_load", None)
    spec.yaml_add_eol_comment("auto requests speculate while the replica holds at most this many requests "
                              "(the table's largest speculating batch size)", "spec_max_load")
    with config.open("w") as f:
        rt.dump(data, f)


def _print(batches, shape_list, plain_s, spec_s, tps, table) -> None:
    t = Table(title="expected tokens/s per request batch (batch x tokens/step / step time)")
    t.add_column("batch")
    t.add_column("plain")
    for s in shape_list:
        t.add_column(f"{s} ({tps[s]:.2f} t/step)")
    for b in batches:
        cells = [f"{b / plain_s[b]:.1f} ({plain_s[b] * 1e3:.0f} ms)"]
        cells += [f"{b * tps[s] / spec_s[b, s]:.1f} ({spec_s[b, s] * 1e3:.0f} ms)" for s in shape_list]
        t.add_row(str(b), *cells)
    console.print(t)
    console.print(f"derived table: {table if table == 'off' else [r.model_dump() for r in table]}")
