"""CLI user errors: exit 2 and exactly one `recflow: ...` line on stderr.

Each message names the file (or glob, or argument) and the field, column or path.
Config and data-header errors are raised before TensorFlow is imported; the
subprocess tests check that, the rest run `recflow.cli.main` in-process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from recflow.cli import main

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "scripts"

HEADER = "user_id,item_id,city,price,click"
ROWS = [
    "1,a,x,1.5,1",
    "2,b,y,0.0,0",
    "3,c,x,2.0,1",
    "4,a,z,3.5,0",
    "5,b,y,1.0,1",
    "6,c,x,0.5,0",
    "7,a,z,4.0,1",
    "8,b,y,2.5,0",
]


def tiny_config(tmp_path: Path, **data) -> dict:
    """A small CSV config: two categorical features, one numeric, two steps."""
    raw = {
        "version": 1,
        "data": {
            "format": "csv",
            "train": str(tmp_path / "train" / "*.csv"),
            "label": "click",
            "batch_size": 4,
            "shuffle": False,
            **data,
        },
        "features": [
            {"name": "user_id", "kind": "categorical", "dtype": "int64", "dim": 4},
            {"name": "item_id", "kind": "categorical", "dtype": "string", "dim": 4},
            {"name": "price", "kind": "numeric", "normalizer": {"type": "log1p"}},
        ],
        "model": {"type": "deepfm", "params": {"dnn": {"hidden_units": [4]}}},
        "train": {"model_dir": str(tmp_path / "run"), "steps": 2, "checkpoint_every_steps": None},
    }
    return raw


def write_config(tmp_path: Path, raw: dict, name: str = "config.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    return str(path)


def write_csv(tmp_path: Path, lines: list[str], name: str = "part-0.csv") -> str:
    folder = tmp_path / "train"
    folder.mkdir(exist_ok=True)
    path = folder / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def run_error(capsys, argv: list[str], *fragments: str) -> str:
    """Runs the CLI in-process; checks exit 2 and one `recflow: ` line holding `fragments`."""
    capsys.readouterr()
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, (code, err)
    assert "Traceback" not in err and "Traceback" not in out
    lines = err.splitlines()
    assert len(lines) == 1, err
    line = lines[0]
    assert line.startswith("recflow: "), line
    for fragment in fragments:
        assert fragment in line, (fragment, line)
    return line


# ----------------------------------------------------------------------------- config errors


def test_bad_config_value(tmp_path, capsys):
    raw = tiny_config(tmp_path)
    raw["features"][1]["dim"] = -3
    config = write_config(tmp_path, raw, "bad.yaml")
    line = run_error(capsys, ["train", config], config, "features[1].dim")
    assert line == f"recflow: {config}: features[1].dim: expected a positive integer, got -3"


def test_unknown_key(tmp_path, capsys):
    raw = tiny_config(tmp_path)
    raw["train"]["learning_rate"] = 0.1
    config = write_config(tmp_path, raw)
    line = run_error(capsys, ["train", config], config)
    assert (
        line
        == f"recflow: {config}: train: unknown key 'learning_rate' (allowed: checkpoint_every_seconds, checkpoint_every_steps, "
        "epochs, evaluate, keep_checkpoints, log_every_steps, model_dir, optimizer, prefetch_embeddings, seed, "
        "sparse_optimizer, steps, xla)"
    )


@pytest.mark.parametrize("command", ["train", "evaluate", "export", "plan"])
def test_every_config_command_validates(tmp_path, capsys, command):
    raw = tiny_config(tmp_path)
    raw["data"]["batch_size"] = "big"
    config = write_config(tmp_path, raw)
    run_error(
        capsys, [command, config], config, "data.batch_size", "expected an integer, got 'big'"
    )


def test_yaml_syntax_error(tmp_path, capsys):
    config = tmp_path / "broken.yaml"
    config.write_text("version: 1\ndata:\n  label: click\n batch_size: 3\n", encoding="utf-8")
    run_error(capsys, ["train", str(config)], str(config), "line 4", "invalid YAML")


def test_missing_config_file(tmp_path, capsys):
    config = str(tmp_path / "missing.yaml")
    run_error(capsys, ["train", config], config, "cannot read config")


def test_bad_set_syntax(tmp_path, capsys):
    write_csv(tmp_path, [HEADER, *ROWS])
    config = write_config(tmp_path, tiny_config(tmp_path))
    run_error(capsys, ["train", config, "--set", "train.steps"], "--set train.steps", "KEY=VALUE")


def test_set_value_validated_against_the_file(tmp_path, capsys):
    write_csv(tmp_path, [HEADER, *ROWS])
    config = write_config(tmp_path, tiny_config(tmp_path))
    run_error(capsys, ["train", config, "--set", "train.steps=-1"], config, "train.steps", "got -1")


@pytest.mark.parametrize(
    "argv, fragment",
    [
        ([], "COMMAND"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["train"], "config"),
        (["train", "a.yaml", "--bogus"], "--bogus"),
        (["data", "synth", "--out", "x", "--rows", "many"], "--rows"),
        (["data", "synth", "--rows", "3"], "--out"),
    ],
    ids=[
        "no-command",
        "unknown-command",
        "no-config",
        "unknown-option",
        "bad-int",
        "missing-option",
    ],
)
def test_bad_arguments(capsys, argv, fragment):
    run_error(capsys, argv, fragment)


# ----------------------------------------------------------------------------- data errors


def test_train_glob_matches_nothing(tmp_path, capsys):
    config = write_config(tmp_path, tiny_config(tmp_path))
    glob = str(tmp_path / "train" / "*.csv")
    run_error(capsys, ["train", config], "data.train", glob, "no files match")


def test_eval_glob_matches_nothing(tmp_path, capsys):
    write_csv(tmp_path, [HEADER, *ROWS])
    raw = tiny_config(tmp_path, eval=str(tmp_path / "eval" / "*.csv"))
    config = write_config(tmp_path, raw)
    run_error(capsys, ["train", config], "data.eval", str(tmp_path / "eval"))


def test_csv_missing_feature_column(tmp_path, capsys):
    data = write_csv(tmp_path, ["user_id,city,price,click", "1,x,1.5,1"])
    config = write_config(tmp_path, tiny_config(tmp_path))
    line = run_error(capsys, ["train", config], data, "'item_id'")
    assert line == f"recflow: {data}: missing column 'item_id' (needed by feature 'item_id')"


def test_csv_missing_column_in_second_file(tmp_path, capsys):
    write_csv(tmp_path, [HEADER, *ROWS], "part-0.csv")
    data = write_csv(tmp_path, ["user_id,item_id,click", "1,a,1"], "part-1.csv")
    config = write_config(tmp_path, tiny_config(tmp_path))
    run_error(capsys, ["train", config], data, "missing column 'price'")


def test_csv_missing_label_column(tmp_path, capsys):
    data = write_csv(tmp_path, ["user_id,item_id,price", "1,a,1.5"])
    config = write_config(tmp_path, tiny_config(tmp_path))
    run_error(capsys, ["train", config], data, "missing column 'click'", "label")


def test_csv_empty_file(tmp_path, capsys):
    data = write_csv(tmp_path, [""])
    config = write_config(tmp_path, tiny_config(tmp_path))
    run_error(capsys, ["train", config], data, "empty file")


# ----------------------------------------------------------------------------- other commands


def test_data_synth_zero_rows(tmp_path, capsys):
    out = tmp_path / "synth"
    run_error(capsys, ["data", "synth", "--out", str(out), "--rows", "0"], "--rows", "got 0")
    assert not out.exists() or not any(out.iterdir())


def test_predict_on_a_dir_that_is_not_a_saved_model(tmp_path, capsys):
    export = tmp_path / "export"
    export.mkdir()
    data = write_csv(tmp_path, [HEADER, *ROWS])
    run_error(capsys, ["predict", str(export), data], str(export), "not a SavedModel")


def test_tables_without_config(tmp_path, capsys):
    model_dir = tmp_path / "empty_run"
    model_dir.mkdir()
    run_error(capsys, ["tables", str(model_dir)], str(model_dir), "config.yaml")


def test_tables_without_checkpoint(tmp_path, capsys):
    model_dir = tmp_path / "run"
    model_dir.mkdir()
    write_config(model_dir, tiny_config(tmp_path))
    run_error(capsys, ["tables", str(model_dir), "--json"], str(model_dir), "no checkpoint")


def test_evaluate_without_checkpoint(tmp_path, capsys):
    write_csv(tmp_path, [HEADER, *ROWS])
    config = write_config(tmp_path, tiny_config(tmp_path))
    model_dir = tmp_path / "elsewhere"
    run_error(
        capsys, ["evaluate", config, "--model-dir", str(model_dir)], str(model_dir), "no checkpoint"
    )


def test_export_without_checkpoint(tmp_path, capsys):
    write_csv(tmp_path, [HEADER, *ROWS])
    config = write_config(tmp_path, tiny_config(tmp_path))
    run_error(capsys, ["export", config], str(tmp_path / "run"), "no checkpoint")


def test_malformed_row_with_on_bad_record_fail(tmp_path, capsys):
    # line 1 is the header; line 4 has a field too few
    lines = [HEADER, *ROWS[:2], "3,c,x,1", *ROWS[3:]]
    data = write_csv(tmp_path, lines)
    config = write_config(tmp_path, tiny_config(tmp_path, on_bad_record="fail"))
    line = run_error(capsys, ["train", config, "--quiet"], data, "line 4")
    assert line.startswith(f"recflow: {data}: line 4: ")


def test_debug_env_shows_the_traceback(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RECFLOW_DEBUG", "1")
    config = str(tmp_path / "missing.yaml")
    assert main(["plan", config]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err
    assert err.splitlines()[-1].startswith(f"recflow: {config}: cannot read config")


def test_unexpected_error_exits_1(capsys, monkeypatch):
    import recflow.cli

    def broken(args):
        raise ValueError("boom")

    monkeypatch.delenv("RECFLOW_DEBUG", raising=False)
    monkeypatch.setitem(recflow.cli._COMMANDS, "tables", broken)
    assert main(["tables", "anywhere"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err
    assert err.splitlines()[-1] == "recflow: unexpected error: ValueError: boom"


# ----------------------------------------------------------------------------- process boundary


def _env() -> dict:
    env = dict(os.environ)
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    env.pop("RECFLOW_DEBUG", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _recflow(tmp_path, *args) -> subprocess.CompletedProcess:
    """`python -m recflow.cli ARGS` in `tmp_path`, its output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "recflow.cli", *args],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_subprocess_config_error_prints_exactly_one_line(tmp_path):
    raw = tiny_config(tmp_path)
    raw["features"][0]["dim"] = -3
    write_config(tmp_path, raw, "bad.yaml")
    proc = _recflow(tmp_path, "train", "bad.yaml")
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "recflow: bad.yaml: features[0].dim: expected a positive integer, got -3"
    ]


def test_subprocess_user_errors_do_not_import_tensorflow(tmp_path):
    raw = tiny_config(tmp_path)
    raw["features"][0]["dim"] = -3
    write_config(tmp_path, raw, "bad.yaml")
    write_csv(tmp_path, ["user_id,item_id,click", "1,a,1"])
    write_config(tmp_path, tiny_config(tmp_path), "nodata.yaml")
    proc = _script(tmp_path, "user_errors_without_tensorflow.py")
    assert proc.stdout.strip() == "False [2, 2, 2, 2, 2, 2, 2, 2]", proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 8, proc.stderr
    assert all(line.startswith("recflow: ") for line in lines)
    assert all("features[0].dim" in line for line in lines[:4])
    assert "missing column 'price'" in lines[4]


def test_subprocess_success_skips_teardown_but_keeps_every_output_byte(tmp_path):
    """`recflow` exits with `os._exit` after a success: the output it printed (into a pipe,
    where stdout is block-buffered) is complete, and the exit code is 0."""
    write_config(tmp_path, tiny_config(tmp_path), "tiny.yaml")
    write_csv(tmp_path, [HEADER, *ROWS])
    proc = _recflow(tmp_path, "data", "check", "tiny.yaml", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)  # parses only when every byte arrived
    assert report


def test_subprocess_data_error_in_the_first_batch_exits_2_with_one_line(tmp_path):
    """A bad label in the first batch fails the run while the evaluation's predict
    function is still being traced in a thread: that thread must not outlive the
    interpreter (a daemon thread inside TensorFlow's C++ code at teardown aborted the
    process: exit 134 and 'terminate called ... FATAL: exception not rethrown')."""
    write_config(tmp_path, tiny_config(tmp_path), "tiny.yaml")
    data = write_csv(tmp_path, [HEADER, "1,a,x,1.5,2", *ROWS[1:]])
    proc = _recflow(tmp_path, "train", "tiny.yaml", "--quiet")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        f"recflow: {data}: line 2: label 'click': a binary task needs 0 or 1, got 2 (map raw "
        "values to 1 with data.positive: {click: [...]}, or use task.type: regression)"
    ]


# ----------------------------------------------------------------------------- issue 19: config
# Config-side findings of issue 19 (4, 6, 9, 10, 11): each failed before its fix.


def test_label_leak_through_column_is_refused(tmp_path, capsys):
    """Finding 4: `{name: leak, kind: categorical, column: click}` trained with AUC 1.0."""
    write_csv(tmp_path, [HEADER, *ROWS])
    raw = tiny_config(tmp_path)
    raw["features"].append({"name": "leak", "kind": "categorical", "column": "click"})
    config = write_config(tmp_path, raw)
    line = run_error(capsys, ["train", config, "--quiet"])
    assert line == (
        f"recflow: {config}: features[3].column: reads the label column 'click': the label would leak in"
    )
    assert not (tmp_path / "run").exists()


def test_duplicate_section_is_refused_naming_both_lines(tmp_path, capsys):
    """Finding 6: a second `train:` block silently dropped the first one's settings."""
    write_csv(tmp_path, [HEADER, *ROWS])
    text = yaml.safe_dump(tiny_config(tmp_path), sort_keys=False)
    text += "train:\n  steps: 5\n"
    first = text.splitlines().index("train:") + 1
    last = len(text.splitlines()) - 1
    config = tmp_path / "config.yaml"
    config.write_text(text, encoding="utf-8")
    line = run_error(capsys, ["train", str(config), "--quiet"])
    assert line == f"recflow: {config}:{last}: duplicate key 'train' (first at line {first})"


@pytest.mark.parametrize(
    "override, fragments",
    [
        # a layer of 1e8 x 1e8 weights: TensorFlow's OOM traceback came after minutes of allocating
        (
            "model.params.dnn.hidden_units=[100000000, 100000000]",
            (
                ": model.params: layer ",
                "`hidden_units` needs 1e+16 float32 weights, with their "
                "gradients at least 80 PB, more than this machine's memory",
            ),
        ),
        (
            "tables.user_id.expected_keys=1e13",
            ("tables.user_id.expected_keys: 10000000000000 keys of dim 4 are allocated up front",),
        ),
        ("train.seed=-1", ("train.seed: expected an integer in [0, 2**32 - 1], got -1",)),
        ("data.synthetic.rows=1e14", ("data.synthetic.rows: 100000000000000 rows",)),
    ],
    ids=["hidden-units", "expected-keys", "seed", "synthetic-rows"],
)
def test_absurd_sizes_are_one_line_before_allocating(tmp_path, capsys, override, fragments):
    """Finding 9: each of these was a traceback (exit 1) after TensorFlow started."""
    write_csv(tmp_path, [HEADER, *ROWS])
    raw = tiny_config(tmp_path)
    raw["tables"] = {"user_id": {"dim": 4}}
    raw["features"][0]["table"] = "user_id"
    del raw["features"][0]["dim"]
    if override.startswith("data.synthetic"):
        raw["data"] = {"format": "synthetic", "label": "click", "batch_size": 4}
        raw["features"] = [
            {"name": "user_id", "kind": "categorical", "dtype": "int64", "table": "user_id"}
        ]
    config = write_config(tmp_path, raw)
    run_error(capsys, ["train", config, "--quiet", "--set", override], *fragments)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_one_wide_layer_is_refused_once_its_input_width_is_known(tmp_path, capsys, monkeypatch):
    """A single wide layer fits while the input width is unknown (1 or more); with this
    machine's memory set to 1 GB, 20M units fit after 1 input (2 x 20M weights, 8 bytes each
    with gradients: 0.32 GB) but not after the 9 of this model (user 4 + item 4 + price 1:
    (9 + 1) x 20M x 8 bytes = 1.6 GB). It is refused before any weight is allocated."""
    from recflow.config import limits

    monkeypatch.setattr(limits, "physical_memory", lambda: 10**9)
    write_csv(tmp_path, [HEADER, *ROWS])
    config = write_config(tmp_path, tiny_config(tmp_path))
    line = run_error(
        capsys, ["train", config, "--quiet", "--set", "model.params.dnn.hidden_units=[20000000]"]
    )
    assert line.endswith(
        "`hidden_units` needs 2e+08 float32 weights after 9 inputs, with their gradients at least "
        "1.6 GB, more than this machine's memory (1 GB). Received: hidden_units=[20000000]"
    ), line


def test_model_params_typo_names_the_path(tmp_path, capsys):
    """Finding 10: `('Keyword argument not understood:', 'foo')` named no path."""
    write_csv(tmp_path, [HEADER, *ROWS])
    config = write_config(tmp_path, tiny_config(tmp_path))
    line = run_error(capsys, ["train", config, "--quiet", "--set", "model.params.foo=1"])
    assert line == f"recflow: {config}: model.params.foo: unknown parameter of deepfm (allowed: dnn, fm, name)"
    line = run_error(capsys, ["train", config, "--quiet", "--set", "model.params.dnn.dropuot=0.1"])
    assert line == (
        f"recflow: {config}: model.params: unknown argument 'dropuot' of DNN (its arguments: hidden_units, "
        "activation, dropout, use_batch_norm, l2, output_units, dtype)"
    )


@pytest.mark.parametrize(
    "override, message",
    [
        ("features[1].knd=categorical", "features[1]: unknown key 'knd' (did you mean 'kind'?)"),
        (
            "features[1].max_len=5",
            "features[1]: unknown key 'max_len': it is for kind 'sequence' "
            "(allowed for kind 'categorical': column, dim, dtype, kind, name, table)",
        ),
        (
            "train.optimizer.learning_rate=1e300",
            "train.optimizer.learning_rate: out of range: "
            "1e+300 (numbers are computed in float32: |x| <= 3.4e38)",
        ),
    ],
    ids=["misspelt-kind", "key-of-other-kind", "1e300"],
)
def test_set_values_get_messages_that_point_the_right_way(tmp_path, capsys, override, message):
    """Finding 10: `features[3].kind: missing`, `unknown key (allowed: data, ...)` for
    `features[5].max_len` (the bracket path set a top-level key), `expected a number, got '1e300'`."""
    write_csv(tmp_path, [HEADER, *ROWS])
    raw = tiny_config(tmp_path)
    if "knd" in override:
        del raw["features"][1]["kind"]
    config = write_config(tmp_path, raw)
    line = run_error(capsys, ["train", config, "--quiet", "--set", override])
    assert line == f"recflow: {config}: {message}"


def test_plan_and_export_do_not_need_data_train(tmp_path, capsys):
    """Finding 11: `recflow plan` and `recflow export` demanded data.train (they read no data)."""
    write_csv(tmp_path, [HEADER, *ROWS])
    raw = tiny_config(tmp_path)
    train_glob = raw["data"].pop("train")
    config = write_config(tmp_path, raw)
    run_error(capsys, ["train", config, "--quiet"], "data.train: required for format 'csv'")
    assert main(["plan", config]) == 0
    assert main(["train", config, "--quiet", "--set", f"data.train={train_glob}"]) == 0
    capsys.readouterr()
    assert main(["export", config]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == str(tmp_path / "run" / "export" / "2"), (out, err)
    assert os.path.isfile(tmp_path / "run" / "export" / "2" / "saved_model.pb")


def test_user_model_next_to_its_config_runs_without_pythonpath(tmp_path, capsys, monkeypatch):
    """Finding 11: `model.type: "mymodule:Cls"` failed from the CLI unless PYTHONPATH was
    set. Found in the config's folder (train) and in the working directory (plan)."""
    import sys

    write_csv(tmp_path, [HEADER, *ROWS])
    folder = tmp_path / "configs"
    folder.mkdir()
    shutil.copy(SCRIPTS / "sibling_tower.py", folder / "issue19_tower_a.py")
    shutil.copy(SCRIPTS / "sibling_units.py", folder / "sibling_units.py")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    path_before = list(sys.path)
    raw = tiny_config(tmp_path)
    raw["model"] = {"type": "issue19_tower_a:Tiny", "params": {"hidden": 2}}
    config = write_config(folder, raw)
    assert main(["train", config, "--quiet"]) == 0, capsys.readouterr().err
    assert sys.path == path_before
    line = run_error(capsys, ["train", config, "--quiet", "--set", "model.params.hiden=2"])
    assert (
        line
        == f"recflow: {config}: model.params.hiden: unknown parameter of issue19_tower_a:Tiny (allowed: hidden, name)"
    )

    shutil.copy(SCRIPTS / "sibling_tower.py", elsewhere / "issue19_tower_b.py")
    shutil.copy(SCRIPTS / "sibling_units.py", elsewhere / "sibling_units.py")
    monkeypatch.delitem(sys.modules, "sibling_units")  # found again, now in the working directory
    raw["model"] = {"type": "issue19_tower_b:Tiny"}
    config = write_config(folder, raw, "cwd.yaml")
    capsys.readouterr()
    assert main(["plan", config]) == 0, capsys.readouterr().err


def test_a_warning_prints_once_when_the_root_logger_has_a_handler(tmp_path, capsys):
    # absl gives the root logger a stderr handler once TensorFlow logs (after the first
    # checkpoint): recflow's own `recflow: warning:` line must still be the only copy.
    import logging

    write_csv(tmp_path, ["user_id,item_id,price,click", "1,a,5000,1", "2,b,-20,0", "3,c,1,1"])
    raw = tiny_config(tmp_path)
    raw["features"][2] = {"name": "price", "kind": "numeric"}  # large raw numbers: a warning
    root = logging.getLogger()
    handler = logging.StreamHandler(sys.stderr)
    root.addHandler(handler)
    try:
        capsys.readouterr()
        assert main(["train", write_config(tmp_path, raw)]) == 0
    finally:
        root.removeHandler(handler)
    err = capsys.readouterr().err
    assert err.count("has no normalizer") == 1, err
    assert "recflow: warning: feature 'price' has no normalizer" in err


def test_launch_starts_its_tasks_without_importing_tensorflow(tmp_path):
    # The launcher checks the config and the data, then only starts processes: a
    # TensorFlow import there would delay every task's start by its own (~2 s).
    # The chief starts last: it clears the model dir's stale temp files as it starts,
    # and the launcher writes cluster.json through one after each start.
    proc = _script_on_good_config(tmp_path, "launch_without_tensorflow.py")
    assert proc.returncode == 0, proc.stderr
    order = "['ps-0', 'ps-1', 'worker-0', 'worker-1', 'chief-0']"
    assert proc.stdout.strip() == f"False {order}", proc.stderr


def test_a_ps_task_runs_tensorflows_server_without_its_python_api(tmp_path):
    # A PS or worker task runs the graphs the chief sends: TF's runtime, not its API
    # (`import tensorflow` costs every task's (re)start ~2.5 CPU s more).
    proc = _script_on_good_config(tmp_path, "server_without_tensorflow_api.py")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False False True", proc.stderr
    assert "cuDNN" not in proc.stderr  # the runtime's load is as quiet as the full import


def _script_on_good_config(folder: Path, name: str) -> subprocess.CompletedProcess:
    """Runs tests/scripts/`name` in `folder`, there given good.yaml (`tiny_config`) and its data."""
    write_csv(folder, ["user_id,item_id,price,click", "1,a,2.0,1"])
    write_config(folder, tiny_config(folder), "good.yaml")
    return _script(folder, name)


def _script(folder: Path, name: str) -> subprocess.CompletedProcess:
    """Runs tests/scripts/`name` in `folder`."""
    return subprocess.run(
        [sys.executable, str(SCRIPTS / name)], cwd=folder, env=_env(), capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip


WRONG_TOWERS = '''
import tensorflow as tf
from recflow.models import RankingModel


class Wide(RankingModel):
    """Logits of the wrong shape: `width` of them a row, or a rank-1 [B]."""

    def __init__(self, config, width=8, **kwargs):
        super().__init__(config, **kwargs)
        self.out = tf.keras.layers.Dense(max(width, 1))
        self.width = width

    def tower(self, inputs, training=False):
        logits = self.out(tf.concat(self.pooled(inputs), axis=1))
        return logits[:, 0] if self.width == 0 else logits


class Named(RankingModel):
    def tower(self, inputs, training=False):
        return {"clicks": tf.add_n([tf.reduce_sum(v, axis=1, keepdims=True) for v in self.pooled(inputs)])}
'''


@pytest.mark.parametrize(
    "model, message",
    [
        ({"type": "wrong_towers:Wide"}, "the tower returned logits of shape [batch, 8]; expected [batch, 1]"),
        ({"type": "wrong_towers:Wide", "params": {"width": 0}},
         "the tower returned logits of shape [batch]; expected [batch, 1]"),
        ({"type": "wrong_towers:Named"}, "the tower returned no logits for task 'probability' (it returned 'clicks')"),
    ],
    ids=["wide", "rank-1", "unknown-task"],
)
def test_a_tower_returning_the_wrong_logits_is_one_line(tmp_path, capsys, model, message):
    """A [B, 8] tower was 30 lines of traceback ending in TF's `Incompatible shapes: [512] vs. [64]`."""
    (tmp_path / "wrong_towers.py").write_text(WRONG_TOWERS, encoding="utf-8")
    write_csv(tmp_path, [HEADER, *ROWS])
    raw = tiny_config(tmp_path)
    raw["model"] = model
    config = write_config(tmp_path, raw)
    line = run_error(capsys, ["train", config, "--quiet"])
    assert line == f"recflow: {config}: model.type: {message}"
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_tables_reads_a_module_model_dir_from_anywhere(tmp_path, capsys):
    """`recflow tables` needs the tables, not the tower: a `module:Class` model dir read
    from another folder failed to find the module (`no module 'my_deepfm'`)."""
    write_csv(tmp_path, [HEADER, *ROWS])
    folder = tmp_path / "configs"
    folder.mkdir()
    (folder / "my_deepfm.py").write_text(
        "from recflow.models.deepfm import DeepFM\n\n\nclass Mine(DeepFM):\n    pass\n", encoding="utf-8"
    )
    raw = tiny_config(tmp_path)
    raw["model"] = {"type": "my_deepfm:Mine", "params": {"dnn": {"hidden_units": [4]}}}
    assert main(["train", write_config(folder, raw), "--quiet"]) == 0, capsys.readouterr().err
    proc = subprocess.run(
        [sys.executable, "-m", "recflow.cli", "tables", str(tmp_path / "run"), "--json"],
        cwd=tmp_path.anchor, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    tables = json.loads(proc.stdout)["tables"]
    ids = {name: {row.split(",")[i] for row in ROWS} for i, name in enumerate(HEADER.split(",")[:2])}
    for name, seen in ids.items():  # each id once, and its first-order weight beside it
        assert tables[name]["keys"] == len(seen), tables
        assert tables[name + ".linear"]["keys"] == len(seen), tables


def _write_examples(path, ids: list) -> None:
    import tensorflow as tf

    with tf.io.TFRecordWriter(str(path)) as out:
        for i, u in enumerate(ids):
            value = (tf.train.Feature(int64_list=tf.train.Int64List(value=[u])) if isinstance(u, int)
                     else tf.train.Feature(bytes_list=tf.train.BytesList(value=[u.encode()])))
            feature = {"user_id": value, "item_id": tf.train.Feature(bytes_list=tf.train.BytesList(value=[b"a"])),
                       "price": tf.train.Feature(float_list=tf.train.FloatList(value=[1.0])),
                       "click": tf.train.Feature(float_list=tf.train.FloatList(value=[float(i % 2)]))}  # fmt: skip
            out.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())


def test_damaged_tfrecord_files_are_named(tmp_path, capsys):
    """A truncated file was `?: damaged file ({{function_node __wrapped__...` cut at 160
    characters; a record of another list type was a traceback (exit 1)."""
    data = tmp_path / "train"
    data.mkdir()
    _write_examples(data / "a.tfrecord", list(range(8)))
    _write_examples(data / "b.tfrecord", list(range(8)))
    whole = (data / "b.tfrecord").read_bytes()
    (data / "b.tfrecord").write_bytes(whole[: len(whole) - 30])  # the last record cut short
    raw = tiny_config(tmp_path, format="tfrecord", train=str(data / "*.tfrecord"))
    raw["train"]["steps"] = 8
    config = write_config(tmp_path, raw)
    line = run_error(capsys, ["train", config, "--quiet"])
    assert line.startswith(f"recflow: {data / 'b.tfrecord'}: record 8: damaged file (truncated record at "), line
    assert "function_node" not in line and "[Op:" not in line, line
    _write_examples(data / "b.tfrecord", [0, 1, "2", 3])  # one record stores the id as bytes
    line = run_error(capsys, ["train", config, "--quiet"])
    assert line == ("recflow: a TFRecord record stores column 'user_id' as a bytes_list, where the first "
                    "record of the first file has an int64_list: store each column as one list type in every record")
