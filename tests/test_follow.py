"""`--follow` trains the records appended to a file it already read, each once.

Each run is `recflow.training.follow.follow` in-process. The stream's writer acts
when the follower is idle (its `time.sleep` is replaced by the next scripted
action), so what was on disk at each poll is known exactly. Expected models are
plain one-pass trainings of the same rows in the same batches.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

from recflow.config import config_from_dict
from recflow.data.consumed import scan
from recflow.data.writer import write_columns
from recflow.training import follow as follow_lib
from recflow.training.tables import restore_engine
from recflow.training.trainer import Trainer

HEADER = "click,user,item\n"


def row(i: int) -> str:
    """Row i: its own user (so the tables show which rows were trained)."""
    return f"{(i * 7) % 3 % 2},{1000 + i},i{i % 5}\n"


def rows(first: int, count: int) -> str:
    return "".join(row(i) for i in range(first, first + count))


def make_config(train: str, model_dir, **train_section):
    return config_from_dict(
        {
            "data": {"format": "csv", "train": str(train), "label": "click", "batch_size": 16,
                     "shuffle": False},
            "features": [
                {"name": "user", "kind": "categorical", "dtype": "int64", "dim": 4},
                {"name": "item", "kind": "categorical", "dtype": "string", "dim": 4},
            ],
            "model": {"type": "deepfm", "params": {"dnn": {"hidden_units": [4]}}},
            "train": {"model_dir": str(model_dir), "epochs": 1, "checkpoint_every_steps": 2,
                      **train_section},
        }  # fmt: skip
    )


class Script:
    """Stands in for `time` in the follow module: each idle poll runs the next action;
    after the last one the trainer is asked to stop."""

    def __init__(self, trainer, actions):
        self.trainer, self.actions = trainer, list(actions)

    def sleep(self, _seconds):
        if self.actions:
            self.actions.pop(0)()
        else:
            self.trainer.request_stop()

    @staticmethod
    def perf_counter():
        return 0.0


def run_follow(monkeypatch, config, actions, callbacks=None):
    """Follows until the actions are done; returns (summary, [(file, examples, step)])."""
    trainer = Trainer(config, verbose=0, callbacks=callbacks)
    monkeypatch.setattr(follow_lib, "time", Script(trainer, actions))
    done = []
    summary = follow_lib.follow(trainer, on_file=lambda *a: done.append(a))
    return summary, done


def train_once(config) -> None:
    """The reference: one pass over the configured files."""
    Trainer(config, verbose=0).fit()


def assert_same_rows(model_dir, reference):
    got, want = restore_engine(str(model_dir)).logical_rows(), restore_engine(str(reference)).logical_rows()
    assert got.keys() == want.keys()
    for name in want:
        a, b = got[name], want[name]
        ia, ib = np.argsort(a.ids), np.argsort(b.ids)
        np.testing.assert_array_equal(a.ids[ia], b.ids[ib], err_msg=name)
        np.testing.assert_array_equal(a.count[ia], b.count[ib], err_msg=name)
        np.testing.assert_allclose(a.emb[ia], b.emb[ib], rtol=1e-5, atol=1e-7, err_msg=name)


def users(model_dir) -> set[int]:
    return set(restore_engine(str(model_dir)).logical_rows()["user"].ids.tolist())


def append(path, text):
    with open(path, "a", encoding="utf-8") as f:
        f.write(text)


def test_appended_rows_are_trained_once_and_a_partial_line_waits_for_its_newline(
    tmp_path, monkeypatch
):
    stream = tmp_path / "stream.csv"
    stream.write_text(HEADER + rows(0, 32), encoding="utf-8")
    last = row(80)
    actions = [
        lambda: append(stream, rows(32, 48) + last[:4]),  # row 80 half written
        lambda: append(stream, last[4:] + rows(81, 15)),
    ]
    summary, done = run_follow(monkeypatch, make_config(stream, tmp_path / "run"), actions)
    path = str(stream)
    assert done == [(path, 32, 2), (path, 48, 5), (path, 16, 6)]
    assert summary["examples"] == 96 and summary["files_consumed"] == [path]

    whole = tmp_path / "whole.csv"
    whole.write_text(HEADER + rows(0, 96), encoding="utf-8")
    train_once(make_config(whole, tmp_path / "reference"))
    assert users(tmp_path / "run") == set(range(1000, 1096))
    assert_same_rows(tmp_path / "run", tmp_path / "reference")


@pytest.mark.parametrize(
    "new_text, why",
    [
        (HEADER + rows(500, 16), "it shrank from"),
        (HEADER.replace("item", "item ") + rows(500, 48), "its first"),  # longer, other bytes
    ],
    ids=["shorter", "changed"],
)
def test_a_rewritten_file_warns_once_and_is_trained_again_from_its_first_row(
    tmp_path, monkeypatch, caplog, new_text, why
):
    stream = tmp_path / "stream.csv"
    stream.write_text(HEADER + rows(0, 32), encoding="utf-8")
    actions = [lambda: stream.write_text(new_text, encoding="utf-8"), lambda: None, lambda: None]
    with caplog.at_level(logging.WARNING, logger="recflow.training.follow"):
        summary, done = run_follow(monkeypatch, make_config(stream, tmp_path / "run"), actions)
    new_rows = new_text.count("\n") - 1
    assert [examples for _, examples, _ in done] == [32, new_rows]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"{stream}: rewritten since it was trained ({why}")
    assert users(tmp_path / "run") == set(range(1000, 1032)) | set(range(1500, 1500 + new_rows))


class Killed(Exception):
    pass


class KillAfter(keras.callbacks.Callback):
    """Dies (no final checkpoint) when the global step reaches `step`."""

    def __init__(self, step):
        super().__init__()
        self.step = step

    def on_train_batch_end(self, batch, logs=None):
        if batch >= self.step:
            raise Killed


def test_killed_in_an_appended_segment_resumes_exactly(tmp_path, monkeypatch):
    stream = tmp_path / "stream.csv"
    reference = tmp_path / "reference.csv"
    for path in (stream, reference):
        path.write_text(HEADER + rows(0, 32), encoding="utf-8")
    grow = [lambda: append(reference, rows(32, 64)), lambda: append(reference, rows(96, 16))]
    run_follow(monkeypatch, make_config(reference, tmp_path / "whole"), grow)

    config = make_config(stream, tmp_path / "run")
    with pytest.raises(Killed):  # steps 3-6 read rows 32-95; the last checkpoint is step 4
        run_follow(monkeypatch, config, [lambda: append(stream, rows(32, 64))], [KillAfter(5)])
    append(stream, rows(96, 16))  # the writer went on while the trainer was down
    summary, done = run_follow(monkeypatch, config, [])
    path = str(stream)
    assert done == [(path, 32, 6), (path, 16, 7)]  # the rest of the segment, then the new rows
    assert summary["steps"] == 7 and summary["files_consumed"] == [path]
    assert_same_rows(tmp_path / "run", tmp_path / "whole")


def test_a_file_rewritten_while_the_trainer_was_down_is_not_resumed_mid_segment(
    tmp_path, monkeypatch, caplog
):
    stream = tmp_path / "stream.csv"
    stream.write_text(HEADER + rows(0, 64), encoding="utf-8")
    config = make_config(stream, tmp_path / "run")
    with pytest.raises(Killed):
        run_follow(monkeypatch, config, [], [KillAfter(3)])
    stream.write_text(HEADER + rows(500, 32), encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="recflow.training.follow"):
        summary, done = run_follow(monkeypatch, config, [lambda: None])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith(f"{stream}: rewritten"), warnings
    assert done == [(str(stream), 32, 4)]  # checkpoint at step 2, then the new file's 2 batches
    assert users(tmp_path / "run") == set(range(1000, 1032)) | set(range(1500, 1532))


def test_a_model_dir_of_an_earlier_recflow_keeps_its_consumed_files(tmp_path, monkeypatch):
    """An earlier recflow saved file names only: such a file counts as consumed whole as
    it is now, and only rows appended later are trained."""
    stream = tmp_path / "stream.csv"
    stream.write_text(HEADER + rows(0, 32), encoding="utf-8")
    config = make_config(stream, tmp_path / "run")
    trainer = Trainer(config, verbose=0)
    trainer.prepare_model_dir()
    state = follow_lib.StreamState()
    trainer.open_checkpoint(stream=state)
    state.consumed.assign(f'["{stream}"]')
    trainer.save_checkpoint()

    summary, done = run_follow(monkeypatch, config, [lambda: append(stream, rows(32, 16))])
    assert done == [(str(stream), 16, 1)]
    assert users(tmp_path / "run") == set(range(1032, 1048))


def test_scan_counts_whole_records_of_each_format(tmp_path):
    csv_path = tmp_path / "a.csv"
    csv_path.write_text(HEADER + rows(0, 3) + "1,10", encoding="utf-8")  # a partial last line
    first = scan(str(csv_path), "csv", True, None).complete
    assert (first.records, first.size) == (3, len(HEADER + rows(0, 3)))
    append(csv_path, "99,i1\n")
    grown = scan(str(csv_path), "csv", True, first)
    assert grown.rewritten is None and grown.complete.records == 4
    assert scan(str(csv_path), "csv", True, grown.complete).complete == grown.complete  # nothing new
    csv_path.write_text(HEADER, encoding="utf-8")
    assert scan(str(csv_path), "csv", True, None).complete.records == 0  # a header is no record
    assert scan(str(csv_path), "csv", True, grown.complete).rewritten.startswith("it shrank from")

    frames = tmp_path / "a.tfrecord"
    with tf.io.TFRecordWriter(str(frames)) as writer:
        for payload in (b"x", b"yy", b"zzz"):
            writer.write(payload)
    whole = frames.read_bytes()  # frames of 1 + 16, 2 + 16 and 3 + 16 bytes
    frames.write_bytes(whole[:-5])
    partial = scan(str(frames), "tfrecord", False, None).complete
    assert (partial.records, partial.size) == (2, 17 + 18)
    frames.write_bytes(whole)
    assert scan(str(frames), "tfrecord", False, partial).complete.records == 3

    table = tmp_path / "a.parquet"
    write_columns(str(table), {"click": np.array([0, 1])}, "parquet")
    content = table.read_bytes()
    table.write_bytes(content[: len(content) // 2])
    assert scan(str(table), "parquet", False, None).complete is None  # no footer yet
    table.write_bytes(content)
    done = scan(str(table), "parquet", False, None).complete
    assert done.records == 1 and done.size == len(content)
    table.write_bytes(content + b"PAR1")
    assert scan(str(table), "parquet", False, done).rewritten == "a Parquet file changed"
