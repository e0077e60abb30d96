"""Guards of the CLI's edges: numbers checked when the arguments are read, damaged
exports, model dirs that are missing or foreign. Each case exits 2 with exactly one
`recflow: ...` line, and writes (or leaves) what the docs say."""

from __future__ import annotations

import pytest

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
