"""`ModelDir`, the one owner of a model dir's state, checked by value: fallback past a
damaged checkpoint, the delta chain across a restart, export versions, atomic
replacement, the writer lock and the lifecycle rebuild's evicted ids."""

import json
import os
import shutil

import numpy as np
import pytest
import tf_keras as keras

from recflow.api import load
from recflow.embedding import lifecycle
from recflow.errors import RecflowError
from recflow.exporter.saved_model import Exporter
from recflow.training import lock
from recflow.training.trainer import Trainer

CONFIG = "configs/deepfm_demo.yaml"
SMALL = {
    "data.synthetic": {"rows": 256, "eval_rows": 64, "seed": 3, "schema": "demo"},
    "data.batch_size": 64,
    "data.shuffle": False,
    "model.params": {"dnn": {"hidden_units": [8]}},
    "tables.user.eviction": {"ttl_steps": 100},
    "train.epochs": None,
    "train.steps": 4,
    "train.checkpoint_every_steps": 2,
    "export.delta_every_steps": 2,
    "train.evaluate": False,  # the checks read checkpoints, deltas and exports
}


def small_config(model_dir, **overrides):
    return load(CONFIG, str(model_dir), dict(SMALL, **overrides))


def state(model) -> dict:
    """The model's dense weights and every table row (raw ids sorted), as numpy."""
    out = {f"dense/{i}": w.numpy().copy() for i, w in enumerate(model.trainable_weights)}
    for name, rows in model.embedding.logical_rows().items():
        order = np.argsort(rows.ids)
        out[f"{name}/ids"], out[f"{name}/emb"] = rows.ids[order], rows.emb[order]
    return out


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def manifest(model_dir, step) -> dict:
    return json.loads((model_dir / "deltas" / str(step) / "manifest.json").read_text())


def files_of(directory) -> dict:
    """Every file under `directory` (relative path -> bytes)."""
    out = {}
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            out[os.path.relpath(path, directory)] = open(path, "rb").read()
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A model dir trained to step 4: checkpoints and deltas at steps 2 and 4; the
    model's state at each step, taken by a user callback."""
    model_dir = tmp_path_factory.mktemp("trained") / "m"
    states = {}

    class Snapshot(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            states[batch] = state(self.model)

    Trainer(small_config(model_dir), verbose=0, callbacks=[Snapshot()]).fit()
    return model_dir, states


@pytest.fixture
def copy(trained, tmp_path):
    model_dir, states = trained
    shutil.copytree(model_dir, tmp_path / "m")
    return tmp_path / "m", states


def restored(model_dir, **overrides) -> Trainer:
    trainer = Trainer(small_config(model_dir, **overrides), verbose=0)
    trainer.model_dir.restore()
    return trainer


def test_restore_falls_back_past_a_damaged_checkpoint_with_its_values(copy):
    model_dir, states = copy
    data = model_dir / "checkpoints" / "ckpt-4.data-00000-of-00001"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])  # a torn write
    trainer = restored(model_dir)
    assert int(trainer.model.global_step) == 2 and trainer.model_dir.saved_step == 2
    assert_same(state(trainer.model), states[2])
    assert int(trainer.model_dir.deltas.sequence) == 1  # the delta of step 2 is the chain's first
    assert sorted(os.listdir(model_dir / "checkpoints" / ".damaged")) == [
        "ckpt-4.data-00000-of-00001", "ckpt-4.index",
    ]
    assert os.listdir(model_dir / "deltas" / ".stale-2") == ["4"]  # replayed, then rewritten


def test_delta_sequence_is_consecutive_across_a_restart_behind_a_delta(copy):
    """Killed after the delta of step 4 and before its checkpoint: the restart replays
    steps 3-4 from checkpoint 2 and continues the chain 1, 2, 3 with no gap or repeat."""
    model_dir, _ = copy
    for path in (model_dir / "checkpoints").glob("ckpt-4.*"):
        path.unlink()
    first = np.load(model_dir / "deltas" / "4" / "user.npz")["keys"]
    Trainer(small_config(model_dir, **{"train.steps": 6}), verbose=0).fit()
    steps = sorted(int(d) for d in os.listdir(model_dir / "deltas") if d.isdigit())
    assert steps == [2, 4, 6]
    chain = [(manifest(model_dir, s)["sequence"], manifest(model_dir, s)["since_step"]) for s in steps]
    assert chain == [(1, 0), (2, 2), (3, 4)]
    replayed = np.load(model_dir / "deltas" / "4" / "user.npz")["keys"]
    np.testing.assert_array_equal(np.sort(replayed), np.sort(first))  # the same steps, the same rows


def test_an_export_version_is_never_rewritten(copy):
    model_dir, _ = copy
    trainer = restored(model_dir)
    path = trainer.model_dir.export()
    assert path == str(model_dir / "export" / "4")
    (model_dir / "export" / "4" / "marker").write_text("first export")
    before = files_of(path)
    assert trainer.model_dir.export() == path  # the same step and structure: kept
    assert files_of(path) == before

    other = model_dir / "export" / "5" / "assets.extra"
    other.mkdir(parents=True)
    (other / "structure.json").write_text('{"model": "another"}')
    trainer.model.global_step.assign(5)
    with pytest.raises(RecflowError, match="versions are never rewritten"):
        trainer.model_dir.export()
    assert files_of(model_dir / "export" / "5") == {"assets.extra/structure.json": b'{"model": "another"}'}


def test_exports_keep_the_newest_versions(copy):
    model_dir, _ = copy
    trainer = restored(model_dir, **{"export.keep": 2})
    for step in (4, 6, 7):
        trainer.model.global_step.assign(step)
        trainer.model_dir.export()
    assert sorted(os.listdir(model_dir / "export")) == ["6", "7"]


def test_a_failed_write_leaves_the_old_dir_whole(copy, monkeypatch):
    model_dir, _ = copy
    trainer = restored(model_dir)
    deltas = model_dir / "deltas"
    before = files_of(deltas / "4")
    assert trainer.model_dir.write_delta() == str(deltas / "4")  # recorded in the checkpoint: kept
    assert files_of(deltas / "4") == before

    # A delta of step 4 that the chain does not record (its last delta: step 2).
    chain = trainer.model_dir.deltas
    chain.step.assign(2)
    chain.sequence.assign(1)
    write = lifecycle.write_delta

    def full_disk(engine, directory, *args, **kwargs):
        (open(os.path.join(directory, "user.npz"), "wb")).write(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(lifecycle, "write_delta", full_disk)
    with pytest.raises(OSError, match="No space"):
        trainer.model_dir.write_delta()
    assert files_of(deltas / "4") == before
    assert sorted(os.listdir(deltas)) == ["2", "4"]  # no temp left
    assert (int(chain.step), int(chain.sequence)) == (2, 1)  # the chain did not move on

    monkeypatch.setattr(lifecycle, "write_delta", write)
    trainer.model_dir.write_delta()  # replaces it, once the new one is complete
    assert (manifest(model_dir, 4)["sequence"], manifest(model_dir, 4)["since_step"]) == (2, 2)
    assert sorted(os.listdir(deltas)) == ["2", "4"]
    assert (int(chain.step), int(chain.sequence)) == (4, 2)

    def broken_save(self, directory, step=None):
        open(os.path.join(directory, "saved_model.pb"), "wb").write(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Exporter, "save", broken_save)
    with pytest.raises(OSError, match="No space"):
        trainer.model_dir.export()
    assert os.listdir(model_dir / "export") == []  # nothing half-written, no temp


def test_a_second_writer_is_refused_and_the_holders_temps_stay(tmp_path):
    path = tmp_path / "m"
    (path / "export" / ".tmp-killed").mkdir(parents=True)  # left by a killed writer
    with lock.writer(str(path), "train"):
        assert not (path / "export" / ".tmp-killed").exists()
        (path / "export" / ".tmp-staging").mkdir()  # the holder's export in progress
        with pytest.raises(RecflowError, match=rf"pid {os.getpid()} \(`recflow train`\)"):
            with lock.writer(str(path), "export"):
                pass
        assert (path / "export" / ".tmp-staging").is_dir()
    with lock.writer(str(path), "export"):  # free once the holder is done
        pass


def test_the_lifecycle_rebuild_keeps_evicted_ids_for_the_next_delta(copy):
    model_dir, states = copy
    trainer = restored(model_dir)
    evicting = ("user", "user.linear")  # the user table and DeepFM's first-order weights of it
    ids = {name: states[4][f"{name}/ids"] for name in evicting}
    assert all(v.size > 0 for v in ids.values())
    trainer.model.global_step.assign(1000)  # every user row is now unseen for > ttl_steps 100
    trainer.model_dir.evict()
    assert trainer.model_dir.evicted_rows == {name: v.size for name, v in ids.items()}
    after = state(trainer.model)
    assert all(after[f"{name}/ids"].size == 0 for name in evicting)
    assert_same({k: v for k, v in after.items() if not k.startswith("user")},
                {k: v for k, v in states[4].items() if not k.startswith("user")})
    trainer.model_dir.write_delta()
    delta = manifest(model_dir, 1000)
    for name, gone in ids.items():
        assert delta["tables"][name]["evicted"] == gone.size and delta["tables"][name]["rows"] == 0
        np.testing.assert_array_equal(np.load(model_dir / "deltas" / "1000" / f"{name}.npz")["evicted"], gone)
    assert all(t["evicted"] == 0 for name, t in delta["tables"].items() if name not in evicting)


def test_a_user_callback_given_the_model_dir_exports_on_its_schedule(copy):
    """The shape docs/models.md shows: a callback that takes `trainer.model_dir`."""
    model_dir, _ = copy

    class ExportEvery(keras.callbacks.Callback):
        def __init__(self, model_dir, every):
            super().__init__()
            self.model_dir, self.every = model_dir, every

        def on_train_batch_end(self, step, logs=None):
            if logs["previous_step"] // self.every < step // self.every:
                self.model_dir.export()

    config = small_config(model_dir, **{"train.steps": 8})
    with lock.writer(config.train.model_dir, "train"):
        trainer = Trainer(config, verbose=0)
        trainer.callbacks.append(ExportEvery(trainer.model_dir, 3))
        trainer.fit()
    assert sorted(os.listdir(model_dir / "export")) == ["6"]  # steps 5..8 cross one multiple of 3
