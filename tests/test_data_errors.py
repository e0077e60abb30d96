"""Data that cannot be read as given gets one line that says what it is and what to
do: a directory for a glob, a wrong delimiter, gzip and UTF-16 files, and in
`recflow predict` a bad value's file and line. Each case runs `recflow.cli.main`
in-process and checks exit 2 and the one `recflow: ` line on stderr."""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import numpy as np
import pytest
import yaml

from recflow.cli import main
from recflow.exporter.predict import predict_file

HEADER = "user,tags,price,click"
ROWS = [f"{i},t{i % 3}|t{i % 5},{i * 0.5},{i % 2}" for i in range(8)]


def config(tmp_path: Path, train: str, **csv) -> str:
    raw = {
        "data": {"format": "csv", "train": train, "label": "click", "batch_size": 4,
                 "shuffle": False, **({"csv": csv} if csv else {})},
        "features": [
            {"name": "user", "kind": "categorical", "dtype": "int64", "dim": 4},
            {"name": "tags", "kind": "multi_hot", "dim": 4, "max_values": 3},
            {"name": "price", "kind": "numeric", "normalizer": {"type": "log1p"}},
        ],
        "model": {"type": "deepfm", "params": {"dnn": {"hidden_units": [4]}}},
        "train": {"model_dir": str(tmp_path / "run"), "steps": 2, "checkpoint_every_steps": None},
    }  # fmt: skip
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return str(path)


def fails(capsys, argv: list[str]) -> str:
    """Runs the CLI; checks exit 2 and one `recflow: ` line; returns it without the prefix."""
    capsys.readouterr()
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, (code, out, err)
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("recflow: "), err
    return lines[0][len("recflow: ") :]


def write(path: Path, lines: list[str], encoding: str = "utf-8") -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(("\n".join(lines) + "\n").encode(encoding))
    return str(path)


def test_a_directory_as_data_train_names_a_glob_of_its_files(tmp_path, capsys):
    folder = tmp_path / "data"
    write(folder / "day1.csv", [HEADER, *ROWS])
    write(folder / "day2.csv", [HEADER, *ROWS])
    write(folder / "notes.txt", ["x"])
    line = fails(capsys, ["train", config(tmp_path, str(folder))])
    assert line == (
        f"data.train: '{folder}' is a directory; name its files with a glob, e.g. '{folder}/*.csv'"
    )


def test_a_wrong_delimiter_names_the_one_in_the_header(tmp_path, capsys):
    data = write(tmp_path / "d.csv", [HEADER.replace(",", ";"), *(r.replace(",", ";") for r in ROWS)])
    line = fails(capsys, ["train", config(tmp_path, data)])
    # features are checked in name order (the config sorts them): price comes first
    assert line == (
        f"{data}: missing column 'price' (needed by feature 'price'); the header holds it "
        "separated by ';' (set data.csv.delimiter: \";\")"
    )
    tabs = write(tmp_path / "t.csv", [HEADER.replace(",", "\t"), *(r.replace(",", "\t") for r in ROWS)])
    line = fails(capsys, ["train", config(tmp_path, tabs, delimiter=";")])
    assert line.endswith("the header holds it separated by tabs (set data.csv.delimiter: \"\\t\")")


def test_a_missing_column_without_another_delimiter_has_no_hint(tmp_path, capsys):
    data = write(tmp_path / "d.csv", ["user,tag,price,click", "1,a,1,1"])
    line = fails(capsys, ["train", config(tmp_path, data)])
    assert line == f"{data}: missing column 'tags' (needed by feature 'tags')"


@pytest.mark.parametrize(
    "encode, what",
    [
        (lambda text: gzip.compress(text.encode()), "a gzip-compressed file; recflow reads plain UTF-8 CSV: decompress it first (gunzip -k)"),
        (lambda text: text.encode("utf-16"), "UTF-16 text (byte order mark FF FE); recflow reads plain UTF-8 CSV: convert it to UTF-8 first (iconv -f UTF-16 -t UTF-8)"),
        (lambda text: text.encode("utf-16-le"), "UTF-16 text (little-endian, no byte order mark); recflow reads plain UTF-8 CSV: convert it to UTF-8 first (iconv -f UTF-16LE -t UTF-8)"),
        (lambda text: text.encode("utf-16-be"), "UTF-16 text (big-endian, no byte order mark)"),
    ],
    ids=["gzip", "utf-16", "utf-16le", "utf-16be"],
)  # fmt: skip
@pytest.mark.parametrize("command", ["train", "data check"])
def test_a_file_that_is_not_utf8_text_says_what_it_is(tmp_path, capsys, encode, what, command):
    data = tmp_path / "d.csv"
    data.write_bytes(encode("\n".join([HEADER, *ROWS]) + "\n"))
    line = fails(capsys, [*command.split(), config(tmp_path, str(data))])
    assert line.startswith(f"{data}: {what}"), line


def test_a_file_that_is_not_utf8_text_without_a_header_line_says_so_too(tmp_path, capsys):
    data = tmp_path / "d.csv"
    data.write_bytes(gzip.compress("\n".join(ROWS).encode()))
    line = fails(capsys, ["train", config(tmp_path, str(data), header=False, columns=HEADER.split(","))])
    assert line.startswith(f"{data}: a gzip-compressed file"), line


# ----------------------------------------------------------------------------- predict


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("export")
    data = write(tmp_path / "train.csv", [HEADER, *ROWS])
    assert main(["train", config(tmp_path, data), "--quiet"]) == 0
    versions = os.listdir(tmp_path / "run" / "export")
    return str(tmp_path / "run" / "export" / max(versions, key=int))


def scores(export_dir: str, path: str) -> np.ndarray:
    return np.array([float(v) for v in predict_file(export_dir, path)])


def test_predict_reads_a_gzip_file_as_its_plain_text(export, tmp_path):
    text = "\n".join([HEADER, *ROWS]) + "\n"
    plain = tmp_path / "d.csv"
    plain.write_text(text, encoding="utf-8")
    packed = tmp_path / "d.csv.gz"
    packed.write_bytes(gzip.compress(text.encode()))
    expected = scores(export, str(plain))
    assert expected.shape == (8,)
    np.testing.assert_array_equal(scores(export, str(packed)), expected)


def test_predict_on_a_directory_is_one_line(export, tmp_path, capsys):
    line = fails(capsys, ["predict", export, str(tmp_path)])
    assert line == f"{tmp_path}: a directory; predict scores one CSV or Parquet file"


def test_predict_on_utf16_text_is_one_line(export, tmp_path, capsys):
    data = tmp_path / "d.csv"
    data.write_bytes("\n".join([HEADER, *ROWS]).encode("utf-16"))
    assert fails(capsys, ["predict", export, str(data)]).startswith(f"{data}: UTF-16 text")


@pytest.mark.parametrize(
    "bad_row, message",
    [
        ("3,t1,x,1", "line 4: column 'price' (input 'price'): expected a number, got 'x'"),
        ("3.5,t1,1,1", "line 4: column 'user' (input 'user'): expected an integer, got '3.5'"),
        ("99999999999999999999,t1,1,1", "line 4: column 'user' (input 'user'): '99999999999999999999' does not fit in int64"),
    ],
    ids=["number", "integer", "int64"],
)  # fmt: skip
def test_predict_names_the_file_and_line_of_a_bad_value(export, tmp_path, capsys, bad_row, message):
    data = write(tmp_path / "d.csv", [HEADER, ROWS[0], "", bad_row, ROWS[1]])  # line 3 is blank
    assert fails(capsys, ["predict", export, data]) == f"{data}: {message}"


def test_predict_with_a_wrong_delimiter_names_it(export, tmp_path, capsys):
    data = write(tmp_path / "d.csv", [HEADER.replace(",", "|"), "1|a|1|1"])
    line = fails(capsys, ["predict", export, data])
    assert line.endswith("the header holds it separated by '|' (set data.csv.delimiter: \"|\")")


def test_predict_cuts_a_long_multi_hot_value_as_training_does(export, tmp_path):
    long_tags = "||t1|t2||t0|" + "|".join(f"x{i}" for i in range(100_000))
    data = write(tmp_path / "d.csv", [HEADER, f"1,{long_tags},2.0,1", "1,t1|t2|t0,2.0,1"])
    got = scores(export, data)
    assert got[0] == got[1]  # max_values 3: the first three values, t1 t2 t0
