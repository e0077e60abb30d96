"""The input cache (`recflow.data.cache`): epochs read from it are the epochs parsing gives.

Files of the demo schema with every kind of feature (int and string categorical,
multi_hot cut to max_values, sequence, numeric log1p / standard / bucketize), a bad
row, a blank line and non-finite numbers: each epoch's batches from the cache must
equal, tensor by tensor, the batches of parsing the files again; training on them
must give the same tables and metrics; a damaged, partial or stale cache is rebuilt;
a run killed with -9 in its second epoch resumes to the uninterrupted run's tables.
"""

import dataclasses
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import procs
import pytest
import tensorflow as tf

import recflow.api
from recflow.config.loader import load_config
from recflow.data import cache as cache_lib
from recflow.data import records, synthetic
from recflow.data.writer import write_columns
from recflow.errors import DataError
from recflow.training.trainer import Trainer

ROWS = 300  # per file
BATCH = 64
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")


def write_files(directory, fmt="csv", files=2):
    """`files` files of the demo schema; the first CSV one also holds a row with a bad
    price, a blank line, "inf" and "nan" prices, and a tags row of 12 values."""
    options = load_config("configs/deepfm_demo.yaml").data.synthetic
    options = dataclasses.replace(options, rows=ROWS * files, eval_rows=50, seed=11)
    columns, _ = synthetic.generate(options, "train")
    paths = []
    for i in range(files):
        path = os.path.join(directory, f"part-{i}.{fmt}")
        write_columns(path, {k: np.asarray(v)[i * ROWS : (i + 1) * ROWS] for k, v in columns.items()},
                      fmt, labels=["click"])  # fmt: skip
        paths.append(path)
    if fmt == "csv":
        with open(paths[0], encoding="utf-8") as f:
            header, *lines = f.read().splitlines()
        names = header.split(",")
        price, tags = names.index("price"), names.index("tags")

        def edited(line, column, value):
            fields = line.split(",")
            fields[column] = value
            return ",".join(fields)

        lines[3] = edited(lines[3], price, "cheap")  # bad: not a number
        lines[5] = edited(lines[5], price, "inf")  # non-finite: read as missing, counted
        lines[8] = edited(lines[8], price, "nan")
        lines[9] = edited(lines[9], tags, "|".join(f"t{k}" for k in range(12)))  # cut to max_values
        lines.insert(20, "")  # blank: ignored, not bad
        with open(paths[0], "w", encoding="utf-8") as f:
            f.write("\n".join([header, *lines]) + "\n")
    return paths


def make_config(tmp_path, files, fmt="csv", epochs=3, cache="auto", model_dir="run", **train):
    overrides = [
        f"data.format={fmt}",
        f"data.train={json.dumps(files)}",
        f"data.eval={json.dumps(files[-1:])}",
        f"data.batch_size={BATCH}",
        "data.shuffle_buffer=256",  # blocks of 32 records, so shuffling moves rows between batches
        f"data.cache={cache}",
        "features.tags.max_values=5",
        f"train.epochs={epochs}",
        "train.checkpoint_every_steps=null",
        "model.params={dnn: {hidden_units: [8]}}",
        f"train.model_dir={tmp_path / model_dir}",
        "export.at_end=false",  # runs are compared by their tables and metrics
    ] + [f"train.{k}={v}" for k, v in train.items()]
    return load_config("configs/deepfm_demo.yaml", overrides=overrides)


def assert_same_batches(a, b):
    a, b = list(a), list(b)
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        tf.nest.assert_same_structure(x, y, expand_composites=True)
        for u, v in zip(tf.nest.flatten(x, expand_composites=True), tf.nest.flatten(y, expand_composites=True)):
            assert u.dtype == v.dtype
            np.testing.assert_array_equal(u.numpy(), v.numpy())  # NaN == NaN, bit for bit otherwise


def rows_of(model_dir):
    from recflow.training.tables import restore_engine

    return restore_engine(str(model_dir)).logical_rows()


def assert_same_tables(model_dir, reference):
    """Every table: the same ids with bit-identical rows (embedding, slots, count, step)."""
    got, want = rows_of(model_dir), rows_of(reference)
    assert got.keys() == want.keys()
    for name in want:
        a, b = got[name], want[name]
        ia, ib = np.argsort(a.ids), np.argsort(b.ids)
        for field in ("ids", "count", "last_step", "emb", "slots"):
            np.testing.assert_array_equal(getattr(a, field)[ia], getattr(b, field)[ib], err_msg=f"{name}.{field}")


@pytest.mark.parametrize("fmt", ["csv", "tfrecord"])
def test_each_epoch_from_the_cache_is_the_batches_of_parsing_again(tmp_path, fmt):
    files = write_files(tmp_path, fmt)
    trainer = Trainer(make_config(tmp_path, files, fmt), verbose=0)
    cache = cache_lib.for_run(trainer.config, files, str(tmp_path / "cache"))
    assert cache.first_epoch == 0
    for epoch in range(3):  # seeded per epoch: three different orders
        assert_same_batches(trainer.epoch_dataset(epoch, cache=cache), trainer.epoch_dataset(epoch))
    if fmt == "csv":  # the bad row and the blank line: one of 2 * ROWS + 1 records is bad, one ignored
        assert cache.records == [ROWS + 1, ROWS] and cache.first == 2
        batches = list(trainer.epoch_dataset(0, cache=cache))
        assert sum(int(b[2]) for b in batches) == 1
        assert sum(int(tf.shape(b[1]["click"])[0]) for b in batches) == 2 * ROWS - 1
        assert sum(int(b[0]["/nonfinite"]) for b in batches) == 2  # "inf", "nan"
        assert sum(int(b[0]["/truncated"]) for b in batches) == 1


@pytest.mark.parametrize("counts", [[300], [5, 0, 700, 1], [256, 256], [7, 1, 1, 1, 90, 2, 0, 40, 3]])
@pytest.mark.parametrize("shuffle", [False, True])
def test_record_keys_made_in_numpy_are_the_per_record_pipelines(counts, shuffle):
    """`file_order` + `interleaved` + `record_blocks` against `numbered(...).batch(size)`
    over record-number readers: the same blocks, bit for bit (empty files, files ending
    mid-cycle and opening in freed slots, blocks across files, short last blocks)."""
    files = [f"f{i}" for i in range(len(counts))]
    table = tf.constant(counts, tf.int64)

    def numbers(name):
        return tf.data.Dataset.range(tf.gather(table, tf.strings.to_number(tf.strings.substr(name, 1, 9), tf.int32)))

    mixed = shuffle and len(counts) > 1
    for seed, size in [(3, 1), (4, 64), (5, 1000)]:
        order = records.file_order(len(counts), seed) if mixed else range(len(counts))
        cycle = min(len(counts), records.INTERLEAVE) if mixed else 1
        made = records.record_blocks(*records.interleaved(order, counts, cycle), 2, size)
        per_record = records.numbered(files, numbers, first=2, shuffle=shuffle, seed=seed).batch(size)
        assert_same_batches(made, per_record)
    keys = np.concatenate([k.numpy() for k, _ in made])  # by hand: every record once
    want = [i * records.FILE_STRIDE + 2 + n for i, c in enumerate(counts) for n in range(c)]
    np.testing.assert_array_equal(np.sort(keys), want)


@pytest.mark.parametrize(("files", "shuffle"), [(1, True), (2, False), (1, False), (5, True)])
def test_epochs_whose_keys_are_made_in_blocks_are_the_batches_of_parsing_again(tmp_path, files, shuffle):
    """Whatever the files and the shuffle, the cache makes the record keys in numpy and
    blocks, and each epoch is still the batches of parsing the files again, tensor by
    tensor (and those of the per-record key pipeline)."""
    paths = write_files(tmp_path, files=files)
    trainer = Trainer(make_config(tmp_path, paths, **{}), verbose=0)
    trainer.config = dataclasses.replace(
        trainer.config, data=dataclasses.replace(trainer.config.data, shuffle=shuffle)
    )
    cache = cache_lib.for_run(trainer.config, paths, str(tmp_path / "cache"))
    for epoch in range(2):
        assert_same_batches(trainer.epoch_dataset(epoch, cache=cache), trainer.epoch_dataset(epoch))
        assert_same_batches(trainer.epoch_dataset(epoch, cache=cache, by_record=True), trainer.epoch_dataset(epoch))
    assert cache.position_record()["order"] == cache_lib.ORDER
    assert "order" not in cache.position_record(by_record=True)


def test_a_position_read_a_record_at_a_time_resumes_in_that_pipeline(tmp_path, monkeypatch):
    """A checkpoint of the version before blocks (its record has no `order`, its position
    is in the per-record pipeline) resumes mid-epoch to the tables of a run never stopped."""
    parts = write_files(tmp_path, files=4)
    files = [str(tmp_path / "all.csv")]  # one file of 1,200 records: its epoch is 19 steps,
    with open(files[0], "w", encoding="utf-8") as out:  # and the keys' pipeline is mid-way
        for i, part in enumerate(parts):  # when the run stops (not at its end)
            with open(part, encoding="utf-8") as f:
                out.writelines(f.readlines()[(1 if i else 0) :])
    Trainer(make_config(tmp_path, files, model_dir="whole"), verbose=0).fit()

    class StopAt(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 22:  # 19 steps per epoch: the fourth of the second
                self.model.stop_training = True

    with monkeypatch.context() as m:  # the version before
        dataset, record = cache_lib.InputCache.dataset, cache_lib.InputCache.position_record
        m.setattr(cache_lib.InputCache, "dataset", lambda self, config, by_record=False: dataset(self, config, True))
        m.setattr(cache_lib.InputCache, "position_record", lambda self, by_record=False: record(self, True))
        stopped = Trainer(make_config(tmp_path, files, model_dir="old"), verbose=0, callbacks=[StopAt()])
        stopped.fit()
    assert int(stopped.model.global_step) == 22
    read = []
    original = cache_lib.InputCache.dataset
    monkeypatch.setattr(
        cache_lib.InputCache, "dataset", lambda self, config, by_record=False: read.append(by_record) or original(self, config, by_record)
    )
    assert Trainer(make_config(tmp_path, files, model_dir="old"), verbose=0).fit()["steps"] == 57
    assert_same_tables(tmp_path / "old", tmp_path / "whole")
    assert read == [True, False]  # the resumed epoch as it was read; the next in blocks


def test_three_epochs_from_the_cache_train_the_tables_and_metrics_of_parsing_again(tmp_path):
    files = write_files(tmp_path)
    parsed = Trainer(make_config(tmp_path, files, cache="off", model_dir="parsed"), verbose=0).run()
    built = []
    original = cache_lib.InputCache._build
    try:
        cache_lib.InputCache._build = lambda self: built.append(1) or original(self)
        cached = Trainer(make_config(tmp_path, files, model_dir="cached"), verbose=0).run()
    finally:
        cache_lib.InputCache._build = original
    assert built == [1]  # parsed once, for three epochs
    assert_same_tables(tmp_path / "cached", tmp_path / "parsed")
    for key in ("steps", "examples", "examples_read", "bad_records", "nonfinite_values", "truncated_rows", "auc"):
        assert cached[key] == parsed[key], key
    assert (cached["bad_records"], cached["nonfinite_values"], cached["truncated_rows"]) == (1 * 3, 2 * 3, 1 * 3)  # per epoch
    assert not os.path.exists(tmp_path / "cached" / "cache")  # its files and the emptied dir


def test_the_next_epochs_input_is_made_while_an_epoch_trains_and_reads_its_batches(tmp_path):
    """The runner makes epoch e + 1's iterator in a thread when epoch e starts; the next
    `start_epoch` hands out that very iterator, which reads the batches of the epoch."""
    files = write_files(tmp_path)
    trainer = Trainer(make_config(tmp_path, files), verbose=0)
    trainer.model_dir.prepare()
    runner = trainer.make_runner()
    runner.start_epoch(0)
    epoch, cached, made = runner._next
    assert (epoch, cached) == (1, True)
    iterator = runner.start_epoch(1)["iterator"]
    assert iterator is made.result()
    assert_same_batches(iterator, trainer.epoch_dataset(1, cache=runner.cache))
    runner.start_epoch(2)
    assert runner._next is None  # the run's last epoch: nothing after it
    # A run that `train.steps` ends may stop inside any epoch: nothing is made ahead.
    stepped = Trainer(make_config(tmp_path, files, model_dir="stepped", steps=25), verbose=0)
    stepped.model_dir.prepare()
    runner = stepped.make_runner()
    runner.start_epoch(0)
    assert runner._next is None


def damage_truncate(path):
    file = sorted(glob.glob(os.path.join(path, "*.npy")))[0]
    with open(file, "r+b") as f:
        f.truncate(os.path.getsize(file) - 8)


def damage_flip(path):
    file = max(glob.glob(os.path.join(path, "*.npy")), key=os.path.getsize)
    with open(file, "r+b") as f:
        f.seek(os.path.getsize(file) - 5)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x01]))


def damage_partial(path):
    """What a writer killed before its rename leaves (a temp dir) and a manifest gone."""
    os.remove(os.path.join(path, cache_lib.MANIFEST))


def damage_manifest(path):
    """A manifest whose record counts lie (its arrays intact): each epoch read half its rows."""
    name = os.path.join(path, cache_lib.MANIFEST)
    with open(name, encoding="utf-8") as f:
        manifest = json.load(f)
    manifest["records"] = [n // 2 for n in manifest["records"]]
    with open(name, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)


def test_a_closed_cache_leaves_no_files_and_removes_only_the_model_dirs_own_dir(tmp_path):
    files = write_files(tmp_path)
    config = make_config(tmp_path, files)
    users = dataclasses.replace(config, data=dataclasses.replace(config.data, cache_dir=str(tmp_path / "mine")))
    for run_config, directory in ((config, tmp_path / "run" / "cache"), (users, tmp_path / "mine")):
        cache = cache_lib.for_run(run_config, files, str(tmp_path / "run" / "cache"))
        assert cache.directory == str(directory)
        os.makedirs(cache.path)  # what a build leaves
        open(os.path.join(cache.path, cache_lib.MANIFEST), "w").close()
        os.makedirs(directory / "train-0123456789abcdef")  # another key's (other files)
        cache.close()
        assert not os.path.exists(cache.path)
    assert not (tmp_path / "run" / "cache").exists()  # the model dir's: removed whole
    assert os.listdir(tmp_path / "mine") == ["train-0123456789abcdef"]  # the user's: others' kept


@pytest.mark.parametrize("damage", [damage_truncate, damage_flip, damage_partial, damage_manifest])
def test_a_damaged_cache_is_rebuilt_not_trusted(tmp_path, damage):
    files = write_files(tmp_path)
    trainer = Trainer(make_config(tmp_path, files), verbose=0)
    directory = str(tmp_path / "cache")
    first = cache_lib.for_run(trainer.config, files, directory)
    first.load()
    damage(first.path)
    again = cache_lib.for_run(trainer.config, files, directory)
    assert again._read() is None  # refused
    assert_same_batches(trainer.epoch_dataset(1, cache=again), trainer.epoch_dataset(1))
    assert cache_lib.for_run(trainer.config, files, directory)._read() is not None  # rebuilt whole


def test_a_changed_file_or_parse_option_invalidates_the_cache(tmp_path):
    files = write_files(tmp_path)
    trainer = Trainer(make_config(tmp_path, files), verbose=0)
    directory = str(tmp_path / "cache")
    cache_lib.for_run(trainer.config, files, directory).load()
    with open(files[1], encoding="utf-8") as f:
        lines = f.read().splitlines()
    lines[1], lines[2] = lines[2], lines[1]  # same size, other rows: only the mtime tells
    stat = os.stat(files[1])
    with open(files[1], "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    os.utime(files[1], ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    changed = cache_lib.for_run(trainer.config, files, directory)
    assert changed._read() is None
    assert_same_batches(trainer.epoch_dataset(0, cache=changed), trainer.epoch_dataset(0))
    other = dataclasses.replace(trainer.config, features=trainer.config.features[:-1])  # no `hour`
    assert cache_lib.for_run(other, files, directory).key != changed.key


def test_a_new_cache_in_the_model_dir_replaces_its_caches_of_other_files(tmp_path):
    files = write_files(tmp_path)
    config = make_config(tmp_path, files)
    directory = tmp_path / "run" / "cache"
    old = directory / "train-0123456789abcdef"  # a cache of the files before they changed
    os.makedirs(old)
    cache_lib.for_run(config, files, str(directory)).load()
    assert os.listdir(directory) == [os.path.basename(cache_lib.for_run(config, files, str(directory)).path)]


def test_a_run_that_its_step_count_ends_removes_its_cache(tmp_path):
    files = write_files(tmp_path)
    trainer = Trainer(make_config(tmp_path, files, epochs="null", steps=25), verbose=0)
    trainer.fit()  # 10 steps an epoch: epochs 2 and 3 read the cache
    assert int(trainer.model.global_step) == 25
    assert not (tmp_path / "run" / "cache").exists()


def test_a_position_resumes_over_the_same_contents_only(tmp_path):
    """A checkpoint's cache position names the files' contents: files touched (same bytes)
    resume it; files of the same record counts but other rows are refused before they are
    parsed (they resumed silently, reading the new rows at the old positions)."""
    files = write_files(tmp_path)

    class StopAt(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 14:  # 10 steps per epoch: in the second, read from the cache
                self.model.stop_training = True

    Trainer(make_config(tmp_path, files), verbose=0, callbacks=[StopAt()]).fit()
    stat = os.stat(files[1])
    os.utime(files[1], ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # touched only
    shutil.copytree(tmp_path / "run", tmp_path / "copy")
    assert Trainer(make_config(tmp_path, files), verbose=0).fit()["steps"] == 30

    with open(files[1], encoding="utf-8") as f:
        lines = f.read().splitlines()
    lines[1], lines[2] = lines[2], lines[1]  # the same records, other rows at their numbers
    with open(files[1], "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    resumed = Trainer(make_config(tmp_path, files, model_dir="copy"), verbose=0)
    with pytest.raises(DataError, match=r"the files changed since .* epoch 2 \(other contents\)"):
        resumed.fit()
    # Nothing was parsed for the refused files: no cache of theirs.
    assert not os.path.exists(cache_lib.for_run(resumed.config, files, str(tmp_path / "copy" / "cache")).path)


def test_a_stopped_run_resumes_mid_epoch_from_where_it_read(tmp_path):
    """Stopped in its second epoch and resumed: the same tables as a run never stopped,
    whether the resumed run keeps the cache, turns it off, or started without it."""
    files = write_files(tmp_path)
    Trainer(make_config(tmp_path, files, model_dir="whole"), verbose=0).fit()  # tables only

    class StopAt(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 14:  # 10 steps per epoch: in the second
                self.model.stop_training = True

    for first, then in [("auto", "auto"), ("auto", "off"), ("off", "auto")]:
        name = f"{first}-{then}"
        stopped = Trainer(make_config(tmp_path, files, cache=first, model_dir=name), verbose=0, callbacks=[StopAt()])
        stopped.fit()  # its final checkpoint holds the position
        assert int(stopped.model.global_step) == 14
        resumed = Trainer(make_config(tmp_path, files, cache=then, model_dir=name), verbose=0)
        assert resumed.fit()["steps"] == 30
        assert_same_tables(tmp_path / name, tmp_path / "whole")


def test_killed_in_epoch_two_with_its_cache_damaged_resumes_to_the_uninterrupted_tables(tmp_path):
    files = write_files(tmp_path)

    def settings(model_dir):
        return [
            "data.format=csv", f"data.train={json.dumps(files)}", f"data.eval={json.dumps(files[-1:])}",
            f"data.batch_size={BATCH}", "data.shuffle_buffer=256", "features.tags.max_values=5",
            "train.epochs=3", "train.checkpoint_every_steps=2", "model.params={dnn: {hidden_units: [8]}}",
            f"train.model_dir={model_dir}", "export.at_end=false", "train.evaluate=false",  # tables
        ]  # fmt: skip

    def command(model_dir):
        return [sys.executable, "-m", "recflow.cli", "train", "configs/deepfm_demo.yaml", "--quiet"] + [
            a for s in settings(model_dir) for a in ("--set", s)
        ]

    whole, killed = tmp_path / "whole", tmp_path / "killed"
    # The run never killed, in this process (what `recflow train` runs); the killed one is a process.
    recflow.api.train("configs/deepfm_demo.yaml", overrides=settings(whole))
    proc = procs.Popen(command(killed), env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    mid_epoch_two = killed / "checkpoints" / "ckpt-14.index"  # 10 steps per epoch
    deadline = time.time() + 300
    while not mid_epoch_two.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL and not (killed / "metrics.json").exists()
    (built,) = glob.glob(str(killed / "cache" / "train-*"))
    damage_flip(built)

    assert procs.run(command(killed), env=ENV, capture_output=True).returncode == 0
    metrics = json.loads((killed / "metrics.json").read_text())
    assert metrics["steps"] == json.loads((whole / "metrics.json").read_text())["steps"] == 30
    assert_same_tables(killed, whole)
    assert not (killed / "cache").exists()  # removed once the run is done
