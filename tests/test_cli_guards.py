"""Guards of the CLI's edges: numbers checked when the arguments are read, damaged
exports, model dirs that are missing or foreign. Each case exits 2 with exactly one
`recflow: ...` line, and writes (or leaves) what the docs say."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
from test_cli_errors import HEADER, ROWS, tiny_config, write_config, write_csv

from recflow.cli import main
from recflow.errors import RecflowError


def run_error(capsys, argv: list[str]) -> str:
    """Runs the CLI in-process; checks exit 2 and one line on stderr; returns that line."""
    capsys.readouterr()
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, (code, err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    lines = err.splitlines()
    assert len(lines) == 1, err[-3000:]
    return lines[0]


# ----------------------------------------------------------------------------- numbers


@pytest.mark.parametrize("value", ["-3", "0"])
def test_predict_batch_size_must_be_positive(tmp_path, capsys, value):
    line = run_error(capsys, ["predict", str(tmp_path / "export"), str(tmp_path / "a.csv"), "--batch-size", value])
    assert line == f"recflow: --batch-size: expected a positive integer, got {value}"


@pytest.mark.parametrize("value", [-3, 0, 2.5, True])
def test_predict_file_refuses_a_batch_size_that_is_not_a_positive_integer(tmp_path, value):
    from recflow.exporter.predict import predict_file

    with pytest.raises(RecflowError) as caught:
        list(predict_file(str(tmp_path / "export"), str(tmp_path / "a.csv"), batch_size=value))
    assert str(caught.value) == f"batch_size: expected a positive integer, got {value!r}"


# ----------------------------------------------------------------------------- damaged exports


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A model dir trained 2 steps on 8 rows, with its export (version 2): (config, model dir, data)."""
    folder = tmp_path_factory.mktemp("trained")
    data = write_csv(folder, [HEADER, *ROWS])
    config = write_config(folder, tiny_config(folder))
    assert main(["train", config, "--quiet"]) == 0
    return config, folder / "run", data


@pytest.fixture
def model_dir(trained, tmp_path):
    """A copy of the trained model dir, to damage."""
    copy = tmp_path / "run"
    shutil.copytree(trained[1], copy)
    return copy


def damage(export: Path, how: str) -> None:
    variables = export / "variables"
    if how == "truncated":
        data = variables / "variables.data-00000-of-00001"
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    elif how == "no-index":
        (variables / "variables.index").unlink()
    else:
        shutil.rmtree(variables)


@pytest.mark.parametrize(
    "how, reason",
    [
        ("truncated", "damaged SavedModel, it does not load: Read less bytes than requested"),
        ("no-index", "damaged SavedModel: variables/variables.index is missing"),
        ("no-variables", "damaged SavedModel: variables/variables.index is missing"),
    ],
)
def test_predict_on_a_damaged_export_is_one_line(trained, model_dir, capsys, how, reason):
    export = model_dir / "export" / "2"
    damage(export, how)
    line = run_error(capsys, ["predict", str(export), trained[2]])
    assert line == f"recflow: {export}: {reason}"


def files_of(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def predicted_lines(capsys, export: Path, data: str) -> list[str]:
    capsys.readouterr()
    assert main(["predict", str(export), data]) == 0
    return capsys.readouterr().out.splitlines()


@pytest.mark.parametrize("how", ["truncated", "no-variables"])
def test_export_writes_a_damaged_version_again_and_sets_it_aside(trained, model_dir, capsys, how):
    config, _, data = trained
    export = model_dir / "export" / "2"
    whole = files_of(export)
    damage(export, how)
    damaged = files_of(export)
    capsys.readouterr()
    assert main(["export", config, "--model-dir", str(model_dir)]) == 0
    out, err = capsys.readouterr()
    assert out == f"{export}\n"
    aside = model_dir / "export" / ".damaged" / "2"
    assert err.startswith(f"recflow: warning: {export}: damaged export (") and f"moved to {aside}" in err
    assert files_of(aside) == damaged  # set aside as it was
    assert files_of(export).keys() == whole.keys()
    original = trained[1] / "export" / "2"  # the same checkpoint: the same scores
    assert predicted_lines(capsys, export, data) == predicted_lines(capsys, original, data)


def test_export_keeps_a_whole_version_as_it_is(trained, model_dir, capsys):
    export = model_dir / "export" / "2"
    before = files_of(export)
    capsys.readouterr()
    assert main(["export", trained[0], "--model-dir", str(model_dir)]) == 0
    assert files_of(export) == before  # not rewritten: same sizes and times
    assert not (model_dir / "export" / ".damaged").exists()


def test_train_of_a_complete_run_writes_its_damaged_export_again(trained, model_dir, capsys):
    export = model_dir / "export" / "2"
    damage(export, "truncated")
    capsys.readouterr()
    assert main(["train", trained[0], "--quiet", "--model-dir", str(model_dir)]) == 0
    err = capsys.readouterr().err
    assert "damaged export" in err
    # it names what is missing (the metrics are there)
    assert "the run that ended at step 2 has no export (missing or damaged); writing its export and metrics" in err
    assert (model_dir / "export" / ".damaged" / "2").is_dir()
    original = trained[1] / "export" / "2"
    assert predicted_lines(capsys, export, trained[2]) == predicted_lines(capsys, original, trained[2])


# ----------------------------------------------------------------------------- model dirs


@pytest.mark.parametrize("command", ["evaluate", "export"])
def test_a_reader_of_a_missing_model_dir_creates_nothing(trained, tmp_path, capsys, command):
    typo = tmp_path / "typo" / "run1"
    line = run_error(capsys, [command, trained[0], "--model-dir", str(typo)])
    assert line == f"recflow: {typo}/checkpoints: no checkpoint to read (train first)"
    assert not (tmp_path / "typo").exists()
    # ... so serve says so, instead of waiting for an export in the dir left behind
    line = run_error(capsys, ["serve", str(typo)])
    assert line == f"recflow: {typo}: no such model dir"


@pytest.mark.parametrize("command", ["evaluate", "export"])
def test_a_reader_of_a_model_dir_without_checkpoint_writes_nothing(trained, tmp_path, capsys, command):
    empty = tmp_path / "empty"
    empty.mkdir()
    line = run_error(capsys, [command, trained[0], "--model-dir", str(empty)])
    assert line == f"recflow: {empty}/checkpoints: no checkpoint to read (train first)"
    assert list(empty.iterdir()) == []


@pytest.mark.parametrize("name", ["checkpoints", "export", "deltas", "logs"])
def test_a_model_dir_with_a_file_in_a_directorys_place_is_refused_before_training(trained, tmp_path, capsys, name):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / name).write_text("x\n")
    line = run_error(capsys, ["train", trained[0], "--quiet", "--model-dir", str(foreign)])
    assert line == (
        f"recflow: {foreign / name}: an existing file where a model dir keeps a directory; not a "
        "recflow model dir? use another --model-dir, or move the file away"
    )
    assert [p.name for p in foreign.iterdir()] == [name]  # nothing written, not even the lock
    assert (foreign / name).read_text() == "x\n"


# ----------------------------------------------------------------------------- more numbers and paths


def test_data_synth_into_an_existing_file_is_one_line(tmp_path, capsys):
    out = tmp_path / "afile"
    out.write_text("file\n")
    line = run_error(capsys, ["data", "synth", "--out", str(out), "--rows", "10"])
    assert line == f"recflow: --out {out}: an existing file, not a directory"
    assert out.read_text() == "file\n"


@pytest.mark.parametrize("option", ["--poll-seconds", "--status-seconds"])
@pytest.mark.parametrize("value, shown", [("-1", "-1"), ("0", "0"), ("-5.5", "-5.5"), ("nan", "nan")])
def test_train_seconds_must_be_positive(trained, tmp_path, capsys, option, value, shown):
    # Checked when the arguments are read, --follow or not (-1 used to train, then fail at the
    # first idle poll: `sleep length must be non-negative`).
    model_dir = tmp_path / "run"
    line = run_error(capsys, ["train", trained[0], option, value, "--model-dir", str(model_dir)])
    assert line == f"recflow: {option}: expected a positive number of seconds, got {shown}"
    assert not model_dir.exists()


# ----------------------------------------------------------------------------- SIGTERM outside the steps


@pytest.fixture
def sigterm_fallback():
    """A SIGTERM handler of the test's own, so that a CLI that leaves SIGTERM alone fails
    the test instead of killing pytest: it records the signal, and the command goes on."""
    received = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    yield received
    signal.signal(signal.SIGTERM, previous)


def sigterm_in(monkeypatch, owner, name):
    """Sends this process SIGTERM as `owner.name` begins (in the main thread)."""
    original = getattr(owner, name)

    def signalled(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, signalled)


def run_interrupted(capsys, argv) -> None:
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 143, (code, err[-3000:])
    assert err.splitlines()[-1] == "recflow: interrupted by SIGTERM" and "Traceback" not in err, err[-3000:]


def test_sigterm_while_starting_stops_like_ctrl_c(trained, tmp_path, capsys, monkeypatch, sigterm_fallback):
    import recflow.cli

    sigterm_in(monkeypatch, recflow.cli, "_load")
    model_dir = tmp_path / "run"
    run_interrupted(capsys, ["train", trained[0], "--quiet", "--model-dir", str(model_dir)])
    assert not model_dir.exists()


def test_sigterm_in_the_evaluation_after_training_stops_like_ctrl_c(
    trained, tmp_path, capsys, monkeypatch, sigterm_fallback
):
    from recflow.training.trainer import Trainer

    sigterm_in(monkeypatch, Trainer, "evaluate")
    model_dir = tmp_path / "run"
    argv = ["train", trained[0], "--quiet", "--model-dir", str(model_dir)]
    run_interrupted(capsys, argv)
    assert (model_dir / "checkpoints" / "ckpt-2.index").exists()
    assert not (model_dir / "metrics.json").exists()  # the run's end is still to be written
    # The export ran beside the evaluation: it is whole, or not there; no staging is left.
    assert [p.name for p in (model_dir / "export").iterdir()] in ([], ["2"])
    monkeypatch.undo()
    capsys.readouterr()
    assert main(argv) == 0  # the rerun writes the evaluation, export and metrics
    assert json.loads((model_dir / "metrics.json").read_text())["steps"] == 2
    original = trained[1] / "export" / "2"
    assert predicted_lines(capsys, model_dir / "export" / "2", trained[2]) == predicted_lines(capsys, original, trained[2])


def test_sigterm_in_an_export_leaves_no_version(trained, model_dir, capsys, monkeypatch, sigterm_fallback):
    from recflow.exporter.saved_model import Exporter

    shutil.rmtree(model_dir / "export")
    sigterm_in(monkeypatch, Exporter, "save")
    run_interrupted(capsys, ["export", trained[0], "--model-dir", str(model_dir)])
    assert list((model_dir / "export").iterdir()) == []  # the staged dir is removed


def test_data_synth_never_replaces_a_file(tmp_path, capsys):
    """commands.md: 'an existing file there is refused'; a second synth replaced train.csv
    (2001 lines -> 11) and exited 0."""
    out = tmp_path / "data"
    assert main(["data", "synth", "--out", str(out), "--rows", "20"]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    line = run_error(capsys, ["data", "synth", "--out", str(out), "--rows", "10"])
    assert line == f"recflow: --out {out}: train.csv is there already (remove it, or write elsewhere)"
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert main(["data", "synth", "--out", str(out), "--rows", "10", "--format", "tfrecord"]) == 0  # other names
